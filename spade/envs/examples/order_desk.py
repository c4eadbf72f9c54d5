import random
from typing import Any, ClassVar

from spade.envs import ToolEnv

FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Julia"]
LAST = ["Ng", "Okafor", "Petrov", "Quinn", "Rossi", "Silva", "Tanaka", "Umar", "Vance", "Weber"]
STREETS = ["Elm St", "Oak Ave", "Pine Rd", "Maple Ln", "Cedar Ct", "Birch Way"]
CITIES = [("Springfield", "01101"), ("Riverton", "82501"), ("Lakeside", "92040"), ("Fairview", "97024")]
SKUS = ["lamp", "kettle", "backpack", "headphones", "teapot", "blanket", "monitor", "desk mat"]

ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "description": "house number and street"},
        "city": {"type": "string"},
        "zip": {"type": "string"},
    },
    "required": ["street", "city", "zip"],
}


class OrderDeskEnv(ToolEnv):
    """A retail support desk: look up a customer's orders, reroute one, tag it, cancel another."""

    max_turns = 16
    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "name": "find_customer",
            "description": "Find a customer by full name. Returns their customer id and email.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "description": "full name, e.g. 'Alice Ng'"}},
                "required": ["name"],
            },
        },
        {
            "name": "list_orders",
            "description": "List a customer's orders, optionally filtered.",
            "parameters": {
                "type": "object",
                "properties": {
                    "customer_id": {"type": "string"},
                    "filters": {
                        "type": "object",
                        "properties": {
                            "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
                            "min_total": {"type": "number"},
                        },
                    },
                },
                "required": ["customer_id"],
            },
        },
        {
            "name": "update_shipping",
            "description": "Change how and where a pending order ships.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "shipping": {
                        "type": "object",
                        "properties": {
                            "method": {"type": "string", "enum": ["standard", "express", "overnight"]},
                            "address": ADDRESS,
                        },
                        "required": ["method", "address"],
                    },
                },
                "required": ["order_id", "shipping"],
            },
        },
        {
            "name": "tag_order",
            "description": "Add tags to an order.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["gift", "fragile", "priority", "vip"]},
                        "minItems": 1,
                    },
                },
                "required": ["order_id", "tags"],
            },
        },
        {
            "name": "cancel_order",
            "description": "Cancel a pending order.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "reason": {"type": "string", "enum": ["customer_request", "out_of_stock", "fraud"]},
                },
                "required": ["order_id", "reason"],
            },
        },
        {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    ]

    def setup(self, rng: random.Random) -> None:
        names = rng.sample([f"{first} {last}" for first in FIRST for last in LAST], 6)
        customers: dict[str, dict[str, Any]] = {}
        orders: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(names):
            city, zip_code = rng.choice(CITIES)
            cid = f"C{100 + i}"
            address = {"street": f"{rng.randint(1, 99)} {rng.choice(STREETS)}", "city": city, "zip": zip_code}
            customers[cid] = {"name": name, "email": name.lower().replace(" ", ".") + "@mail.test", "address": address}
            for _ in range(rng.randint(3, 5)):
                oid = f"O{1000 + len(orders)}"
                orders[oid] = {
                    "customer_id": cid,
                    "item": rng.choice(SKUS),
                    "total": round(rng.uniform(10, 400), 2),
                    "day": rng.randint(1, 60),
                    "status": rng.choice(["pending", "pending", "shipped", "delivered"]),
                    "shipping": {"method": "standard", "address": dict(address)},
                    "tags": [],
                }
        cid = rng.choice(sorted(customers))
        mine = [o for o in sorted(orders) if orders[o]["customer_id"] == cid]
        for oid, day in zip(mine, sorted(rng.sample(range(1, 60), len(mine))), strict=True):
            orders[oid]["day"] = day  # Distinct days, so "oldest" is never ambiguous.
        for oid in mine[:3]:  # The caller has at least three pending orders.
            orders[oid]["status"] = "pending"
        pending = [o for o in mine if orders[o]["status"] == "pending"]
        self.target = max(pending, key=lambda o: (orders[o]["total"], o))
        by_day = sorted(pending, key=lambda o: orders[o]["day"])
        if by_day[0] == self.target:  # The order to cancel must not be the one being rerouted.
            other = by_day[1]
            orders[other]["day"], orders[self.target]["day"] = orders[self.target]["day"], orders[other]["day"]
        self.oldest = min(pending, key=lambda o: orders[o]["day"])
        city, zip_code = rng.choice([c for c in CITIES if c[0] != customers[cid]["address"]["city"]])
        self.new_address = {"street": f"{rng.randint(100, 999)} {rng.choice(STREETS)}", "city": city, "zip": zip_code}
        self.customer = cid
        self.state = {"customers": customers, "orders": orders, "found": None, "listed": None}
        name = customers[cid]["name"]
        addr = self.new_address
        self.instructions = [
            f"Hi, this is {name}. Could you look me up and show me my pending orders?",
            f"Please ship my most expensive pending order by express to my new address: {addr['street']}, "
            f"{addr['city']} {addr['zip']}.",
            "That one is a present: tag it as a gift and as fragile, please.",
            "And cancel my oldest pending order (the other ones stay); I ordered it by mistake.",
        ]
        target, oldest, new_address = self.target, self.oldest, self.new_address
        self.criteria = [
            lambda s: s["found"] == cid and s["listed"] == [cid, "pending"],
            lambda s: s["orders"][target]["shipping"] == {"method": "express", "address": new_address},
            lambda s: {"gift", "fragile"} <= set(s["orders"][target]["tags"]),
            lambda s: (
                s["orders"][oldest]["status"] == "cancelled" and s["orders"][oldest].get("reason") == "customer_request"
            ),
        ]

    def _order(self, order_id: str) -> dict[str, Any]:
        if order_id not in self.state["orders"]:
            raise KeyError(f"no order {order_id!r}")
        return self.state["orders"][order_id]

    def tool_find_customer(self, name: str) -> dict[str, str] | str:
        for cid, customer in sorted(self.state["customers"].items()):
            if customer["name"].lower() == name.strip().lower():
                self.state["found"] = cid
                return {"customer_id": cid, "email": customer["email"]}
        return f"No customer named {name!r}."

    def tool_list_orders(self, customer_id: str, filters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        filters = filters or {}
        if customer_id not in self.state["customers"]:
            raise KeyError(f"no customer {customer_id!r}")
        rows = []
        for oid, order in sorted(self.state["orders"].items()):
            if order["customer_id"] != customer_id:
                continue
            if "status" in filters and order["status"] != filters["status"]:
                continue
            if order["total"] < filters.get("min_total", 0):
                continue
            rows.append(
                {
                    "order_id": oid,
                    "item": order["item"],
                    "total": order["total"],
                    "placed_day": order["day"],
                    "status": order["status"],
                }
            )
        self.state["listed"] = [customer_id, filters.get("status", "any")]
        return rows

    def tool_update_shipping(self, order_id: str, shipping: dict[str, Any]) -> str:
        order = self._order(order_id)
        if order["status"] != "pending":
            return f"Order {order_id} is {order['status']}; only pending orders can be changed."
        order["shipping"] = {"method": shipping["method"], "address": dict(shipping["address"])}
        return f"Order {order_id} will ship {shipping['method']} to {shipping['address']['street']}."

    def tool_tag_order(self, order_id: str, tags: list[str]) -> dict[str, Any]:
        order = self._order(order_id)
        order["tags"] = sorted(set(order["tags"]) | set(tags))
        return {"order_id": order_id, "tags": order["tags"]}

    def tool_cancel_order(self, order_id: str, reason: str) -> str:
        order = self._order(order_id)
        if order["status"] != "pending":
            return f"Order {order_id} is {order['status']} and cannot be cancelled."
        order["status"] = "cancelled"
        order["reason"] = reason
        return f"Order {order_id} cancelled ({reason})."

    def tool_get_weather(self, city: str) -> str:
        return f"The weather in {city}: mild, light wind."

    def solution(self) -> list[list[dict[str, Any]]]:
        name = self.state["customers"][self.customer]["name"]
        return [
            [
                {"name": "find_customer", "arguments": {"name": name}},
                {"name": "list_orders", "arguments": {"customer_id": self.customer, "filters": {"status": "pending"}}},
            ],
            [
                {
                    "name": "update_shipping",
                    "arguments": {
                        "order_id": self.target,
                        "shipping": {"method": "express", "address": dict(self.new_address)},
                    },
                }
            ],
            [{"name": "tag_order", "arguments": {"order_id": self.target, "tags": ["gift", "fragile"]}}],
            [{"name": "cancel_order", "arguments": {"order_id": self.oldest, "reason": "customer_request"}}],
        ]
