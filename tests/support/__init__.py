"""Test and benchmark support, kept out of the installed package (it needs the dev extra).

- ``tiny_model``: a tiny random Llama saved to disk (no download);
- ``server_process``: ``trio-llm serve`` as a child process, for end-to-end tests and benches;
- ``procfs``: a process tree, its file descriptors and sockets, read from ``/proc``;
- ``sse``, ``metrics_scrape``: reading a stream of server-sent events and ``/metrics``;
- ``chaos``: chaos trials, built from ``load`` (the clients), ``faults`` (what a trial
  injects) and ``checks`` (what it checks afterwards).
"""
