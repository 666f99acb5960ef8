from __future__ import annotations

import itertools
import re

import pytest
import torch

from primus_perf.problems import AttentionProblem, GemmProblem, dtype_name


def _brute_pairs(sq: int, skv: int, causal: bool) -> int:
    if not causal:
        return sq * skv
    offset = skv - sq
    return sum(1 for i in range(sq) for j in range(skv) if j <= i + offset)


@pytest.mark.parametrize("sq,skv", [(1, 1), (7, 7), (5, 9), (9, 5), (128, 128), (3, 100), (100, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_score_pairs_matches_brute_force(sq: int, skv: int, causal: bool) -> None:
    p = AttentionProblem(1, 2, 1, sq, skv, 64, causal=causal)
    assert p.score_pairs == _brute_pairs(sq, skv, causal)


def test_causal_mask_pairs_match_torch_sdpa_mask() -> None:
    # torch's is_causal mask is top-left aligned for sq != skv; flash-attn's is bottom-right.
    # We count bottom-right (the trainer always has sq == skv, where both agree).
    sq = skv = 33
    mask = torch.ones(sq, skv, dtype=torch.bool).tril()
    assert int(mask.sum()) == AttentionProblem(1, 1, 1, sq, skv, 8).score_pairs


def test_attention_flops() -> None:
    p = AttentionProblem(4, 32, 8, 4096, 4096, 128, causal=False)
    assert p.forward_flops == 4 * 4 * 32 * 4096 * 4096 * 128
    assert p.backward_flops == p.forward_flops * 5 // 2


@pytest.mark.parametrize("at,bt", list(itertools.product([False, True], repeat=2)))
def test_row_major_mapping_computes_the_same_product(at: bool, bt: bool) -> None:
    """Carry out the column-major product the problem describes on raw storage and compare
    with torch's row-major result."""
    M, N, K = 5, 7, 3
    torch.manual_seed(0)
    a_store = torch.randn(K, M) if at else torch.randn(M, K)
    b_store = torch.randn(N, K) if bt else torch.randn(K, N)
    a = a_store.T if at else a_store
    b = b_store.T if bt else b_store
    expected = a @ b  # row-major M x N

    p = GemmProblem.from_row_major(M, N, K, a_transposed=at, b_transposed=bt, dtype="f32")
    assert p.row_major_shapes() == (M, N, K, at, bt)

    def col_major(storage: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
        flat = storage.contiguous().reshape(-1)
        return torch.stack([flat[c * ld : c * ld + rows] for c in range(cols)], dim=1)

    # BLAS A is torch's B storage, BLAS B is torch's A storage.
    A = col_major(b_store, p.k if p.trans_a else p.m, p.m if p.trans_a else p.k, p.lda)
    B = col_major(a_store, p.n if p.trans_b else p.k, p.k if p.trans_b else p.n, p.ldb)
    opA = A.T if p.trans_a else A
    opB = B.T if p.trans_b else B
    D = opA @ opB  # m x n column-major
    # column-major m x n == row-major n x m, i.e. D.T is the row-major result
    torch.testing.assert_close(D.T, expected)


def test_linear_is_tn() -> None:
    p = GemmProblem.from_row_major(4096, 14336, 4096, b_transposed=True)
    assert (p.m, p.n, p.k, p.trans_a, p.trans_b) == (14336, 4096, 4096, True, False)
    assert (p.lda, p.ldb, p.ldd) == (4096, 4096, 14336)
    assert p.key().startswith("gemm:TN|m14336|n4096|k4096")


def test_key_is_canonical_and_round_trips() -> None:
    explicit = GemmProblem(8, 16, 32, lda=8, ldb=32, ldc=8, ldd=8)
    packed = GemmProblem(8, 16, 32)
    assert explicit == packed and explicit.key() == packed.key()
    batched = GemmProblem(8, 16, 32, batch=4)
    assert batched.stride_a == 8 * 32 and batched.key() != packed.key()
    assert GemmProblem.from_dict(batched.to_dict()) == batched
    attn = AttentionProblem(2, 8, 2, 128, 128, 64)
    assert AttentionProblem.from_dict(attn.to_dict()).key() == attn.key()


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError):
        GemmProblem(0, 1, 1)
    with pytest.raises(ValueError):
        GemmProblem(4, 4, 4, lda=2)
    with pytest.raises(ValueError):
        AttentionProblem(1, 6, 4, 8, 8, 64)
    with pytest.raises(ValueError):
        GemmProblem.from_dict({"m": 1, "n": 1, "k": 1, "bogus": 1})


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bf16"
    assert dtype_name("c10::BFloat16") == "bf16"
    assert dtype_name("float") == "f32"
    with pytest.raises(ValueError):
        dtype_name("int8")


def test_a_problems_file_without_problems_or_with_a_yaml_bomb_is_named(tmp_path) -> None:
    from primus_perf.base.errors import ConfigError
    from primus_perf.problems import load_problems

    empty, bomb = tmp_path / "empty.json", tmp_path / "bomb.yaml"
    empty.write_text('{"problems": []}')
    bomb.write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))
    with pytest.raises(ConfigError, match=f"{empty}: the problems file lists no problem"):
        load_problems(empty)
    with pytest.raises(ConfigError, match=f"{bomb}: cannot read the problems file: .*YAML bomb"):
        load_problems(bomb)


@pytest.mark.parametrize("item,said", [
    ({"kind": "gemm", "problem": {"M": 2**64, "N": 4, "K": 4}}, "M must be a positive int of at most 2147483647"),
    ({"kind": "gemm", "problem": {"m": 4, "n": 2**64, "k": 4}}, "GemmProblem.n is 18446744073709551616, more than"),
    ({"kind": "gemm", "problem": {"m": 4, "n": 4, "k": 4, "trans_a": "yes"}}, "trans_a must be true or false"),
    ({"kind": "gemm", "problem": {"m": 4.0, "n": 4, "k": 4}}, "GemmProblem.m must be an int, got 4.0"),
    ({"kind": "attention", "problem": {"batch": 1, "heads_q": 2, "heads_kv": 2, "seq_q": 8, "seq_kv": 8,
                                       "head_dim": 8, "causal": "maybe"}}, "causal must be true or false, got 'maybe'"),
    ({"kind": "grouped_gemm", "problem": {"groups": 4, "k": 8, "n": 8, "tokens": 64, "skew": float("nan")}},
     "skew must be a finite number"),
])
def test_every_problem_type_checks_its_fields_types_and_sizes(item, said, tmp_path) -> None:
    """One check for every problem type (ProblemType runs it before the type's own): a value
    of the wrong type or past what a kernel takes is named, in a problems file too."""
    import json

    from primus_perf.base.errors import ConfigError
    from primus_perf.problems import load_problems, problem_from_item

    with pytest.raises(ValueError, match=re.escape(said)):
        problem_from_item(item)
    path = tmp_path / "p.json"
    path.write_text(json.dumps([item]))
    with pytest.raises(ConfigError, match=f"{re.escape(str(path))} item 0: .*{re.escape(said)}"):
        load_problems(path)
