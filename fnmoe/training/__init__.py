"""Training: the loss and the step, the train state, the loop and its steps, evaluation.

step.py (loss_fn, make_train_step, init_state, eval_loss), state.py (TrainState: what a step
carries to the next, below the step and fnmoe.checkpoint), loop.py (`fnmoe train`: ranks, the run
directory, signals, a run set up), loop_steps.py (the steps from the first to the last save:
metrics rows, held-out loss, samples, checkpoints), evaluate.py (`fnmoe eval`: held-out loss and
bits per byte per data source).
"""
