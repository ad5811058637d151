"""fragsearch model: what a checkpoint needs to serve (data readers, sentence and image fragments, encoders, the
S_kl score, calibration data, checkpoints), the objectives, and the named variants. Training and evaluation are
training/'s."""
