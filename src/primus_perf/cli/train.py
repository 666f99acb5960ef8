"""``primus-train``: run the reference trainer (one process, or every rank under torchrun)."""

from __future__ import annotations

from typing import Optional

import typer

from primus_perf.base.errors import Interrupted
from primus_perf.cli.common import VERSION_HELP, console, run_app

app = typer.Typer(name="primus-train", add_completion=False, epilog=VERSION_HELP)


def format_step(m, total: int) -> str:
    mfu = "n/a" if m.mfu is None else f"{100 * m.mfu:5.1f}%"
    share = f"  optimizer {100 * m.optimizer_s / m.step_time_s:4.1f}%" if m.optimizer_s is not None else ""
    micro = f" ({m.micro_batches} x {m.micro_step_s * 1e3:.1f} ms)" if m.micro_batches > 1 else ""
    return (
        f"step {m.step:>4}/{total}  loss {m.loss:8.4f}  {m.step_time_s * 1e3:8.1f} ms{micro}"
        f"  {m.tokens_per_s:>10,.0f} tok/s  MFU {mfu}  mem {m.peak_mem_bytes / 2**30:6.2f} GiB"
        f"  lr {m.lr:.2e}  gnorm {m.grad_norm:.3f}{share}"
    )


@app.command()
def train(
    overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional here)
        None, help="Config overrides key=value with dotted keys, e.g. train.steps=50 parallel.tp=2"
    ),
    config: str = typer.Option(
        "tiny", "--config", "-c", help="Preset name (tiny, llama3-8b, ...) or a YAML path"
    ),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Override model.n_layers"),  # noqa: UP045
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Override train.steps"),  # noqa: UP045
    json_log: Optional[str] = typer.Option(  # noqa: UP045
        None, "--json-log", help="Write one JSON object per step to this file (JSON lines; it appears under"
        " this name at the end, on Ctrl-C, SIGTERM or an error, holding every finished step)"
    ),
    plan: Optional[str] = typer.Option(  # noqa: UP045
        None, "--plan", help="A step plan (primus-tune step's plan.yaml): its keys over the overrides' (it was "
                             "tuned with them)"),
    print_config: bool = typer.Option(
        False, "--print-config", help="Print the resolved config (preset, YAML and overrides applied) as YAML"
        " and exit without training"),
) -> None:
    """Train a preset or YAML config; prints loss, step time, tokens/s, MFU and peak memory
    per step. Under torchrun every rank runs it (rank 0 prints and writes the log).
    Exit codes: 0 done, 2 bad config or environment, 3 the loss became NaN or infinite,
    130 interrupted (Ctrl-C or SIGTERM)."""
    from primus_perf.trainer.config import load_config, read_plan, with_settings
    from primus_perf.trainer.loop import JsonLog, Trainer
    from primus_perf.tuner.online import InStepTuning

    settings = read_plan(plan) if plan else {}
    if layers is not None:
        settings["model.n_layers"] = layers
    if steps is not None:
        settings["train.steps"] = steps
    cfg = with_settings(load_config(config, overrides or []), settings)
    if print_config:
        import yaml

        console.print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), highlight=False, markup=False)
        return
    trainer = Trainer(cfg, online=InStepTuning() if cfg.tuning.online else None)
    done = 0
    try:
        log = JsonLog(json_log) if (json_log and trainer.is_main) else None
    except BaseException:
        trainer.close()
        raise
    m, g = cfg.model, trainer.groups
    fsdp = f" (FSDP2 shard {g.dp_shard} x replicate {g.dp_replicate})" if g.dp_shard > 1 else ""
    if trainer.is_main:
        console.print(
            f"[bold]{m.name}[/]: {m.n_layers} layers, dim {m.dim}, heads {m.n_heads}/{m.n_kv_heads},"
            f" vocab {m.vocab_size} | tp {g.tp} dp {g.dp}{fsdp} | device"
            f" {trainer.device_name} | {'bf16 autocast' if trainer.autocast else 'fp32'} |"
            f" {trainer.tokens_per_step} tokens/step (micro-batch {cfg.train.micro_batch} x {trainer.accumulation}"
            f" x dp {g.dp}) | {trainer.flops_per_token / 1e9:.3f} GFLOP/token",
            highlight=False,
            soft_wrap=True,
        )
    if trainer.is_main and trainer.fp8:
        fp8 = sorted(n for n, r in trainer.fp8.items() if r != "bf16")
        console.print(f"FP8: {len(fp8)} of {len(trainer.fp8)} linear layers"
                      f" ({', '.join(sorted({trainer.fp8[n] for n in fp8})) or 'none'})", highlight=False, soft_wrap=True)
    if trainer.is_main and trainer.tuning is not None:
        for line in trainer.tuning.start_lines():
            console.print(line, highlight=False, soft_wrap=True)
    finished = False
    try:
        for _ in range(cfg.train.steps):
            metrics = trainer.train_step()
            done += 1
            if not trainer.is_main:
                continue
            if log is not None:
                log.write(metrics)
            if metrics.step % cfg.train.log_every == 0 or metrics.step == cfg.train.steps:
                console.print(
                    format_step(metrics, cfg.train.steps), highlight=False, soft_wrap=True
                )
        finished = True
    except KeyboardInterrupt:
        kept = f"the JSON log {json_log} holds {log.steps} step(s)" if log is not None and log.steps else \
            "nothing was written"
        raise Interrupted(f"after {done} of {cfg.train.steps} steps; {kept}") from None
    finally:
        try:
            if log is not None:
                log.close()
        finally:
            if trainer.is_main and trainer.tuning is not None:
                for line in trainer.tuning.end_lines():
                    console.print(line, highlight=False, soft_wrap=True)
            trainer.close(finished=finished)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
