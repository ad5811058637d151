"""fragsearch training: the offline jobs that make and measure a model (training, evaluation,
calibration fitting, feature extraction), each a command (`python -m fragsearch.training.<job>`).

They build on model/ (fragments, encoders, S_kl, checkpoints); the service and the index never
import this package, except the one door through which a first start trains a missing model
(`fragsearch.training.train.train_variant`, called by service/prepare.py).
"""
