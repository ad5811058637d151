"""fragsearch model: what a checkpoint needs to serve (data readers, sentence and image fragments, encoders, the
S_kl score, calibration data, checkpoints), the one query side (model/embed.py) and the named variants. Training,
its objectives and evaluation are training/'s."""
