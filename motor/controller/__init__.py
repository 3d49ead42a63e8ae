"""The controller: registry of nodes and instances, instance states, live instance table.

Entry points: :class:`motor.controller.server.ControllerServer` (in-process),
:func:`motor.controller.server.run_controller` (blocking, signal handling),
``python -m motor controller`` (child process).
"""
