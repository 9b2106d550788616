"""Importing this registers the rules of ``examples/`` (a subprocess's ``--plugin``)."""

import examples_plugin

for _name in examples_plugin.MODULES:
    examples_plugin.optimizer(_name)
