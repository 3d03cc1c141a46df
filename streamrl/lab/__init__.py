"""The laboratory: the paper-scale simulator, the benches, stage profiling, the planner, the
namespace cluster and offline ranker evaluation.

The lab may import the runtime; no runtime module imports the lab
(``tests/test_layers.py`` checks this over the AST). The CLI (``streamrl.commands``) sits above both.
"""
