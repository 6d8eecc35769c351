"""Text: everything between strings and token ids, pure and free of I/O.

- `tokenizer`: the model's tokenizer (`Tokenizer`) and its chat template;
  `chat_template` renders templates in a sandbox.
- `incremental`: token ids -> text, one token at a time (`IncrementalDetokenizer`).
- `stop`: stop-string matching (`StopMatcher`, an Aho–Corasick automaton).
- `output`: one request's output assembly: stop tokens, stop strings, logprobs aligned
  with the text (`RequestDetokenizer`). Shared by the API server (inline mode) and the
  detokenizer child (3-process mode).
- `token_delta`: one request's new output tokens as the engine handle delivers them
  (`TokenDelta`).
- `choice`: one choice of a response (`Choice`): engine deltas in, text deltas out,
  whichever process detokenized them.
"""
