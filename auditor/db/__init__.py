"""SQL layer: table models and engine/session construction."""
