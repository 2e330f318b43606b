"""The engine: one model on one mesh, stepping every running sequence (``loop`` drives
``scheduler`` -> ``batch`` -> ``runner`` -> ``scheduler.postprocess``). Requests, pages and the
scheduler are plain Python (``request``, ``block_manager``, ``scheduler``); the runner owns the
device state (``runner``); ``distributed`` mirrors it over several processes.

This package's ``__init__`` imports nothing, so ``service.engine.config`` stays free of JAX for
the command line's parser."""
