"""Knowledge of Megatron-LM: the parallel sizes (:mod:`.sizes`), the process groups they give
(:mod:`.groups`, :mod:`.layout`), inferring the sizes from observed communicator member sets
(:mod:`.infer`), and the model's defaults and parameter counts (:mod:`.model`).

Kept free of the emulator: the analysis may use it. Imports nothing, not even lazily: a stage
that needs the model's defaults does not carry the layout inference into its code stamp;
import the module you use.
"""
