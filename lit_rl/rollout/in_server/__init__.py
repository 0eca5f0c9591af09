"""Code that runs inside a vLLM server's processes, not the trainer's: the `lit_rl_gloo` weight-transfer engine
(`vllm_transfer_plugin`), registered through the `vllm.general_plugins` entry point in `pyproject.toml`."""
