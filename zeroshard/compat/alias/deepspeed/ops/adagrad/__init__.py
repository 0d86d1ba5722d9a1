from zeroshard.compat.optimizers import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
