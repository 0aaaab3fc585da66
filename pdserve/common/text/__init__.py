"""Text in and out: the tokenizer and the chat template."""
