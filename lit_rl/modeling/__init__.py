"""The policy, reference and value models and their forward paths: loading (`models`), LoRA (`lora`), the critic
(`value_model`), and the ways a batch goes through a model: head chunks (`head`), padding-free packing
(`packing`) and one forward of a shared prompt for its whole group (`shared_prompts`)."""
