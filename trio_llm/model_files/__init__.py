"""The model's files: finding and loading a model (`loader.py`), the models known by name
(`named_models.py`: PyPI packages), GGUF conversion and its cache (`gguf_convert.py`), the
``--dtype auto`` / ``--kv-cache-dtype auto`` choices (`dtype_choice.py`) and weight
files' headers read as untrusted input (`weight_headers.py`).
"""
