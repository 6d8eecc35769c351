"""Files and batches: ``/v1/files`` (uploads), ``/v1/batches`` (`routes.py`), and the batch
runner that runs their lines (`runner.py`, `line_runner.py`, `lines.py`).
"""
