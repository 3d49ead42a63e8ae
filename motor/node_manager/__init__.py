"""The node manager: launches one node's engines, supervises them, registers and heartbeats.

Entry points: :class:`motor.node_manager.agent.NodeAgent` (in-process),
:func:`motor.node_manager.agent.run_node_manager` (blocking, signal handling),
``python -m motor node-manager`` (child process).
"""
