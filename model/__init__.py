"""fragsearch model: fragments, encoders, the S_kl score, objectives, training and evaluation."""
