# expect: ok
# stdout: median=7 top3=[15, 12, 9]
import heapq
import statistics

scores = [3, 9, 7, 15, 12, 5, 7]
print(f"median={statistics.median(scores)} top3={heapq.nlargest(3, scores)}")
print(f"stdev={statistics.stdev(scores):.2f}")
