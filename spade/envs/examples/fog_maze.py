import random
import re
from collections import deque
from typing import Any

Cell = tuple[int, int]
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


class FogMazeEnv:
    """Walk through a foggy 6x6 maze to the exit; only the four neighbouring cells are visible."""

    max_turns = 25
    SIZE = 6

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.walls: set[Cell] = set()
        self.pos: Cell = (0, 0)
        self.goal: Cell = (0, 0)
        self.turn = 0
        self.visited: set[Cell] = set()

    def _shortest_path(self, start: Cell, goal: Cell) -> list[str] | None:
        queue: deque[tuple[Cell, list[str]]] = deque([(start, [])])
        seen = {start}
        while queue:
            cell, path = queue.popleft()
            if cell == goal:
                return path
            for name, (dr, dc) in MOVES.items():
                nxt = (cell[0] + dr, cell[1] + dc)
                if self._open(nxt) and nxt not in seen:
                    seen.add(nxt)
                    queue.append((nxt, [*path, name]))
        return None

    def _open(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.SIZE and 0 <= c < self.SIZE and cell not in self.walls

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        while True:
            corners = [(0, 0), (0, self.SIZE - 1), (self.SIZE - 1, 0), (self.SIZE - 1, self.SIZE - 1)]
            self.pos = self.rng.choice(corners)
            self.goal = (self.SIZE - 1 - self.pos[0], self.SIZE - 1 - self.pos[1])
            cells = [(r, c) for r in range(self.SIZE) for c in range(self.SIZE)]
            self.walls = {cell for cell in cells if self.rng.random() < 0.3} - {self.pos, self.goal}
            path = self._shortest_path(self.pos, self.goal)
            if path is not None and len(path) <= self.max_turns - 5:
                break
        self.turn = 0
        self.visited = {self.pos}
        intro = (
            f"You are lost in a foggy {self.SIZE}x{self.SIZE} maze. Rows and columns are numbered from 0; "
            f"row 0 is the top. You stand at {self.pos}; the exit is at {self.goal}. You only see the "
            f"cells next to you. You have {self.max_turns} moves.\n"
            "Actions: \\boxed{move up}, \\boxed{move down}, \\boxed{move left}, \\boxed{move right}.\n"
        )
        return intro + self._view(), {"position": list(self.pos)}

    def _view(self) -> str:
        parts = []
        for name, (dr, dc) in MOVES.items():
            nxt = (self.pos[0] + dr, self.pos[1] + dc)
            parts.append(f"{name}: {'open' if self._open(nxt) else 'wall'}")
        return f"Position {self.pos}, exit {self.goal}. Around you: " + ", ".join(parts) + "."

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        left = self.max_turns - self.turn
        match = re.search(r"\\boxed\{\s*(?:move\s+)?(up|down|left|right)\s*\}", action.lower())
        if not match:
            msg = "Invalid action. Use \\boxed{move up|down|left|right}. "
        else:
            dr, dc = MOVES[match.group(1)]
            nxt = (self.pos[0] + dr, self.pos[1] + dc)
            if self._open(nxt):
                self.pos = nxt
                self.visited.add(nxt)
                msg = f"You move {match.group(1)}. "
            else:
                msg = f"A wall blocks the way {match.group(1)}. "
        if self.pos == self.goal:
            return f"You reach the exit in {self.turn} moves!", 1.0, True, False, {}
        if left <= 0:
            return msg + "You are out of moves; the fog closes in.", 0.0, False, True, {}
        return msg + self._view() + f" {left} moves left.", 0.0, False, False, {"position": list(self.pos)}

    def solution(self) -> list[str]:
        return ["\\boxed{move " + m + "}" for m in self._shortest_path(self.pos, self.goal) or []]
