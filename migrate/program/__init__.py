"""The training program as a whole: which modules make it up and what flows between them.

A training program is rarely one file: `train.py` imports the project's `data.py`,
`engine.py`, `utils.py`. `graph` finds those modules from the entry scripts (never installed
packages); `facts` computes, once per program and from CPython's `ast` (cheap, picklable), the
cross-module facts that per-module rules cannot see: which function parameters receive a
wrapped model from another module, which modules are entry points, whether the program trains
at all. Rules read them through `Context.program` (a `ModuleView`); no rule code lives here.
"""
