"""The engines the Accelerator can hand a model to: DeepSpeed, Megatron-LM, FSDP, bitsandbytes, fp8, XLA.

Each integration is loaded when a plugin or a prepared model asks for it, never by ``import
notebook_accel.state`` (tests/test_state_import.py): importing this package imports none of them.
The Accelerate paths (``utils.deepspeed``, ``utils.fsdp_utils``, ``utils.bnb``...) are small lazy
faces over these modules.
"""
