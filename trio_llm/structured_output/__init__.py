"""Structured output's checks and grammars, shared by the API process (which checks a
spec when the request comes in) and the engine (which compiles it over the model's
vocabulary): neither side's code, so neither imports the other.

The library choice and its figures are in docs/structured-output.md. A spec passes three
gates, cheapest first:

1. `spec_limits.check_spec_limits`: sizes and counts on the spec's text (the API
   process, before any grammar work), so an oversized spec costs a scan of its text
   before its 400.
2. `grammar_check.check_structured_output`: the grammar is built and its first mask
   computed over a 256-byte vocabulary (the API process has no model tokenizer), with
   llguidance's own resource limits (`grammar_check.parser_limits`); a grammar that
   fails, or that no finite string matches (``start: start``, a ``$ref`` cycle:
   `unsatisfiable.unsatisfiable_reason`), is refused.
3. `trio_llm.engine.grammar_compiler.GrammarCompiler`: the same with the model's
   vocabulary, in the engine, in a pool of worker threads, off the step's path.

Modules: `errors` (the exceptions and llguidance's messages as one line),
`spec_limits`, `unsatisfiable` (JSON Schemas no finite value matches),
`schema_rewrites` (dropping keywords that say nothing, closing object schemas),
`grammar` (llguidance's grammar text for a spec) and `grammar_check`. They import only
`trio_llm.messages`, msgspec, llguidance (lazily: `spec_limits` never) and the standard
library.
"""
