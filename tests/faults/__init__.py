"""Fault injection for tests: a reverse proxy that fails render/derender calls on demand (proxy.py).

Engine faults come from the simulator's own hooks (token_engine/simulator/faults.py).
"""
