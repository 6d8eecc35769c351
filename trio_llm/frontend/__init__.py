"""Parent-process side of the engine: process supervision, EngineClient, tokenizer."""
