"""Model code: architecture config, the Llama-family decoder, weight loaders, tokenizer, attention."""
