"""Training the tiny model family: corpus, tokenizer, target pretraining, drafter distillation."""
