"""One kernel, several machines: the agents that run a launch's ranks on other nodes, and the kernel's side of them.

``channel`` (the authenticated connection), ``agent`` (``python -m notebook_accel.nodes.agent``,
started on each node by a placement engine), ``remote`` (the kernel's ``NodeGroup``), ``workers``
(the remote ranks behind the launcher's own interfaces), ``relay`` (Unix-socket streams for the
interactive ranks), ``plan`` (the launch plan of a multi-node launch).
"""
