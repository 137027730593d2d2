"""The scored hash table (key -> slot), the row arrays (slot -> row), and what runs on
rows: initializers, admission, dedup, the fused optimizer updates."""
