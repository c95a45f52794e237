"""The shim: the per-run process (``main.py``, run by path as ``python3 -I -S main.py``)."""
