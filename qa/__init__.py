"""Long-context QA task and the trained base/fine-tuned model pair it evaluates.

Owns the synthetic task (`qa.task`), its word-level tokenizer (`qa.tokenizer`), SQuAD-style
metrics (`qa.metrics`), training batches (`qa.batches`), training (`python -m qa.train`),
in-process predictors (`qa.predict`) and evaluation (`python -m qa.evaluate pair`).
Knows nothing about grpc, the producer/consumer services or KV codecs.
"""
