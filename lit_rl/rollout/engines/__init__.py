"""The engines that sample completions, one module each: `hf` (the policy's own decoding, with `compact_decode`),
`vllm` (an in-process vLLM engine beside the policy, placed by `placement`) and `vllm_server` (vLLM servers over
HTTP, through `lit_rl.rollout.server`); `vllm_config` holds what both vLLM engines' configs share (dtype names,
transfers, the checks). A run picks one with `model.rollout.engine` (`lit_rl.rollout.engine_config`)."""
