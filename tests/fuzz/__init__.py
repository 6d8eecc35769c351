"""Opt-in fuzz tests (``TRIO_LLM_FUZZ=1``); see test_openapi_fuzz.py."""
