"""Collective hook (this folder on PYTHONPATH, COUNT_DIR set): every torch.distributed call made
inside a runtime call, with the call's name, step, start and end, and each rank's events; each
process writes $COUNT_DIR/r<pid>.json at exit. Read by bench/trace/analyze_collectives.py; run
through bench/trace/run_plan.py."""
import os, json, time, collections
if os.environ.get("COUNT_DIR"):
    import torch.distributed as dist
    import real_py.rlhf.runtime as R
    CUR = [None, 0]
    LOG = []
    def wrap(name):
        f = getattr(dist, name)
        def g(*a, **k):
            t = time.time()
            try:
                return f(*a, **k)
            finally:
                if CUR[0]:
                    LOG.append((CUR[1], CUR[0], name, t, time.time()))
        setattr(dist, name, g)
    for n in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "send", "recv", "isend", "irecv",
              "reduce_scatter_tensor", "all_gather_object", "broadcast_object_list", "barrier", "batch_isend_irecv", "gather", "scatter"):
        if hasattr(dist, n): wrap(n)
    _call = R.Runtime._call
    def _c(self, i, name, step, *rest):
        CUR[0], CUR[1] = name, step
        t = time.time()
        try:
            return _call(self, i, name, step, *rest)
        finally:
            LOG.append((step, name, "CALL", t, time.time()))
            CUR[0] = None
    R.Runtime._call = _c
    _it = R.Runtime.iteration
    def it(self, step):
        out = _it(self, step)
        LOG.append((step, "-", "EVENTS", [e for e in out["events"] if e[0] == self.rank], 0))
        return out
    R.Runtime.iteration = it
    import atexit
    def dump():
        if not dist.is_initialized() and not LOG: return
        with open(os.path.join(os.environ["COUNT_DIR"], f"r{os.getpid()}.json"), "w") as f:
            json.dump(LOG, f)
    atexit.register(dump)
