# expect: ok
# stdout: loaded model with 3 weights
import pickle

model = {"weights": [0.1, 0.2, 0.7], "bias": 0.05}
with open("model.pkl", "wb") as f:
    pickle.dump(model, f)
with open("model.pkl", "rb") as f:
    loaded = pickle.load(f)
print(f"loaded model with {len(loaded['weights'])} weights")
