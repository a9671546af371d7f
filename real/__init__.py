"""The real pair's test bed: SmolLM2-135M-Instruct (P, shared.pretrained) and its LoRA fine-tune
made here (C), long contexts of real prose with RULER-style scored tasks, the task-free KL
measure, and the fine-tune command. Sits above qa (the toy pair's test bed, whose SQuAD metrics and
greedy decoding it reuses) and below bench."""
