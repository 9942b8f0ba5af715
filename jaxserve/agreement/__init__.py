"""Agreement between runs of one model on different platforms or settings (CPU/GPU/TPU, dtypes, attention
backends, TP): `record` writes what one run computes on a fixed prompt set (agreement.record), and `compare`
lines records up position by position and reports how far they agree (agreement.compare)."""
