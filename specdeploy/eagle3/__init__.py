"""The EAGLE-3 head: training data written by the target (data, prompts, generation), training with ModelOpt (train,
train_loop, modelopt) and export."""
