"""The attention kind of the tuner (``plugin``): Triton tile search (``search``, over the
``space``) raced against torch's SDPA backends."""
