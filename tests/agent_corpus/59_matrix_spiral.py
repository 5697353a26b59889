# expect: ok
# stdout: [1, 2, 3, 6, 9, 8, 7, 4, 5]
def spiral(matrix):
    out = []
    while matrix:
        out += matrix.pop(0)
        matrix = [list(r) for r in zip(*matrix)][::-1]
    return out


print(spiral([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
