"""The notebooks nbval executes: all but several_machines.ipynb, which needs machines to reach.

tests/test_notebooks_cluster.py runs that one on the test suite's cluster of network namespaces, where
there is one (Linux, as root); elsewhere it is skipped, saying why.
"""

collect_ignore = ["several_machines.ipynb"]
