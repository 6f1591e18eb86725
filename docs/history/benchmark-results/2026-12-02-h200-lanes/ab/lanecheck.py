"""How many engine steps went through the stager (not the step's inlined lanes), on CUDA."""
import sys
sys.path.insert(0, "benchmarks")
import bench_engine_loop as b
from blocktable.step.host import DecodeStager
calls = [0]
stage = DecodeStager.stage
def counted(self, *a):
    calls[0] += 1
    return stage(self, *a)
DecodeStager.stage = counted
r = b.decode_workload("cuda", 256, 64, True)
print("decode-256:", r["steps"], "decode steps;", calls[0], "steps through DecodeStager.stage")
calls[0] = 0
r = b.demo_workload("cuda", 16, 1, True)
print("demo:", r["steps"], "steps;", calls[0], "through DecodeStager.stage")
