"""The server process's top level: the supervisor (`supervisor.py`), one model's engines
(`engine_fleet.py`), the models of a server (`model_catalog.py`, `model_pool.py`,
`model_room.py`, `model_memory.py`) and `trio-llm run-batch` (`run_batch.py`).
"""
