"""Pure planning: what the ranks will do, as data (no MLX arrays)."""
