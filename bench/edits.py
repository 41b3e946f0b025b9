"""The edit workload (issue #24): what a coding agent's sub-agent asks most.

Each task shows a file of 15-40 lines and asks for one small change (a rename,
a changed value, an added argument) with the whole file back and nothing else.
The files are written for this benchmark (held out: no model saw them), in the
languages agents edit. ``NATURAL`` is the other side: open chat questions whose
answers copy nothing from the prompt.
"""

from __future__ import annotations

_INVENTORY = '''import json
from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    tags: list[str] = field(default_factory=list)


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, item):
        if item.sku in self.items:
            self.items[item.sku].quantity += item.quantity
        else:
            self.items[item.sku] = item

    def remove(self, sku, quantity):
        item = self.items[sku]
        if item.quantity < quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= quantity

    def total(self):
        return sum(item.quantity for item in self.items.values())

    def save(self, path):
        with open(path, "w") as f:
            json.dump({sku: vars(item) for sku, item in self.items.items()}, f)
'''

_RETRY = '''import time
import random


def retry(func, attempts=3, delay=0.5):
    """Call func until it succeeds or attempts run out."""
    last_error = None
    for attempt in range(attempts):
        try:
            return func()
        except Exception as error:
            last_error = error
            wait = delay * (2 ** attempt) + random.random() * 0.1
            time.sleep(wait)
    raise RuntimeError(f"gave up after {attempts} attempts") from last_error


def fetch_with_retry(client, url):
    return retry(lambda: client.get(url), attempts=5)
'''

_STATS_JS = '''export function mean(values) {
  if (values.length === 0) {
    return 0;
  }
  let total = 0;
  for (const value of values) {
    total += value;
  }
  return total / values.length;
}

export function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  if (sorted.length % 2 === 0) {
    return (sorted[middle - 1] + sorted[middle]) / 2;
  }
  return sorted[middle];
}

export function variance(values) {
  const m = mean(values);
  return mean(values.map((value) => (value - m) ** 2));
}
'''

_CONFIG = '''import os
from pathlib import Path

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"


def load_settings(path=None):
    settings = {"port": DEFAULT_PORT, "host": DEFAULT_HOST, "debug": False}
    if path is None:
        path = Path.home() / ".app" / "settings.ini"
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if "=" not in line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    if "APP_PORT" in os.environ:
        settings["port"] = int(os.environ["APP_PORT"])
    if os.environ.get("APP_DEBUG") == "1":
        settings["debug"] = True
    return settings
'''

_QUEUE_GO = '''package queue

import "errors"

var ErrEmpty = errors.New("queue is empty")

type Queue struct {
	items []int
}

func New() *Queue {
	return &Queue{items: make([]int, 0)}
}

func (q *Queue) Push(value int) {
	q.items = append(q.items, value)
}

func (q *Queue) Pop() (int, error) {
	if len(q.items) == 0 {
		return 0, ErrEmpty
	}
	value := q.items[0]
	q.items = q.items[1:]
	return value, nil
}

func (q *Queue) Len() int {
	return len(q.items)
}
'''

_TEST = '''import pytest

from shop.cart import Cart, Product


def test_empty_cart_total_is_zero():
    cart = Cart()
    assert cart.total() == 0


def test_adding_products_sums_prices():
    cart = Cart()
    cart.add(Product("apple", price=3))
    cart.add(Product("pear", price=4))
    assert cart.total() == 7


def test_discount_applies_to_total():
    cart = Cart(discount=0.5)
    cart.add(Product("apple", price=10))
    assert cart.total() == 5


def test_negative_price_is_rejected():
    with pytest.raises(ValueError):
        Product("broken", price=-1)
'''

_HANDLER = '''from http import HTTPStatus


def handle_request(request, store):
    user_id = request.params.get("user_id")
    if user_id is None:
        return {"status": HTTPStatus.BAD_REQUEST, "error": "user_id is required"}
    user = store.find_user(user_id)
    if user is None:
        return {"status": HTTPStatus.NOT_FOUND, "error": f"no user {user_id}"}
    orders = store.orders_for(user_id)
    return {
        "status": HTTPStatus.OK,
        "user": {"id": user.id, "name": user.name},
        "orders": [{"id": order.id, "total": order.total} for order in orders],
    }
'''

_SHAPES_TS = '''interface Point {
  x: number;
  y: number;
}

export class Rectangle {
  constructor(
    private readonly origin: Point,
    private readonly width: number,
    private readonly height: number,
  ) {}

  area(): number {
    return this.width * this.height;
  }

  contains(point: Point): boolean {
    return (
      point.x >= this.origin.x &&
      point.x <= this.origin.x + this.width &&
      point.y >= this.origin.y &&
      point.y <= this.origin.y + this.height
    );
  }
}
'''

# (language, file, the change asked for)
EDITS: tuple[tuple[str, str, str], ...] = (
    ("python", _INVENTORY, "Rename the method `total` to `count_units`."),
    ("python", _RETRY, "Rename the parameter `delay` to `base_delay` everywhere."),
    ("javascript", _STATS_JS, "Rename the function `mean` to `average` everywhere."),
    ("python", _CONFIG, "Change the default port from 8080 to 9090."),
    ("go", _QUEUE_GO, "Rename the method `Len` to `Size`."),
    ("python", _TEST, "Rename `test_discount_applies_to_total` to `test_half_price_discount`."),
    ("python", _HANDLER, "Rename the parameter `store` to `repository` everywhere."),
    ("typescript", _SHAPES_TS, "Rename the class `Rectangle` to `Box`."),
)


def edit_messages(i: int) -> list[dict]:
    """Task ``i`` (cycling through :data:`EDITS`) as one chat message."""
    language, code, change = EDITS[i % len(EDITS)]
    return [
        {
            "role": "user",
            "content": f"{change} Output only the complete updated code, nothing else.\n\n"
            f"```{language}\n{code}```",
        }
    ]


NATURAL: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who collects sea glass.",
    "Explain how a refrigerator keeps food cold, for a curious ten-year-old.",
    "What are some good habits for staying focused while studying?",
    "Describe a walk through a busy market on a summer morning.",
    "Give me three ideas for a birthday party for my grandmother.",
    "Why do leaves change colour in autumn?",
    "Write a friendly letter inviting a neighbour to dinner.",
    "What should I pack for a week-long hiking trip in the mountains?",
)


def natural_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": NATURAL[i % len(NATURAL)]}]
