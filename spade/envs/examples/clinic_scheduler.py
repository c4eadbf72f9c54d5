import random
from typing import Any, ClassVar

from spade.envs import ToolEnv

DOCTORS = ["Dr. Adler", "Dr. Baptiste", "Dr. Costa", "Dr. Duval", "Dr. Eze"]
DAYS = ["mon", "tue", "wed", "thu", "fri"]
TIMES = ["08:30", "09:00", "09:30", "10:00", "10:30", "11:00", "13:00", "13:30", "14:00", "15:00", "16:00"]
PATIENTS = ["Mara Lind", "Tomas Reyes", "Ines Varga", "Kofi Mensah", "Lena Brandt", "Omar Haddad"]
INSURERS = ["Helvetia Care", "NorthStar Health", "BluePeak Mutual"]
REASONS = ["checkup", "follow_up", "vaccination", "consultation"]


class ClinicSchedulerEnv(ToolEnv):
    """A clinic front desk: register a new patient, find a doctor's free slots, book, and remind."""

    max_turns = 14
    tools: ClassVar[list[dict[str, Any]]] = [
        {
            "name": "register_patient",
            "description": "Register a new patient. Returns the new patient id.",
            "parameters": {
                "type": "object",
                "properties": {
                    "patient": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "phone": {"type": "string"},
                            "insurance": {
                                "type": "object",
                                "properties": {"provider": {"type": "string"}, "member_id": {"type": "string"}},
                                "required": ["provider", "member_id"],
                            },
                        },
                        "required": ["name", "phone", "insurance"],
                    }
                },
                "required": ["patient"],
            },
        },
        {
            "name": "search_slots",
            "description": "List a doctor's free appointment slots on one weekday.",
            "parameters": {
                "type": "object",
                "properties": {
                    "doctor": {"type": "string", "description": "e.g. 'Dr. Adler'"},
                    "day": {"type": "string", "enum": DAYS},
                },
                "required": ["doctor", "day"],
            },
        },
        {
            "name": "book_appointment",
            "description": "Book a free slot for a registered patient.",
            "parameters": {
                "type": "object",
                "properties": {
                    "patient_id": {"type": "string"},
                    "slot_id": {"type": "string"},
                    "reason": {"type": "string", "enum": REASONS},
                },
                "required": ["patient_id", "slot_id", "reason"],
            },
        },
        {
            "name": "send_reminder",
            "description": "Schedule reminders for an appointment.",
            "parameters": {
                "type": "object",
                "properties": {
                    "appointment_id": {"type": "string"},
                    "channels": {"type": "array", "items": {"type": "string", "enum": ["sms", "email", "call"]}},
                    "hours_before": {"type": "integer", "minimum": 1, "maximum": 72},
                },
                "required": ["appointment_id", "channels", "hours_before"],
            },
        },
        {
            "name": "cancel_appointment",
            "description": "Cancel an appointment and free its slot.",
            "parameters": {
                "type": "object",
                "properties": {"appointment_id": {"type": "string"}},
                "required": ["appointment_id"],
            },
        },
        {
            "name": "get_clinic_news",
            "description": "Latest announcements of the clinic.",
            "parameters": {"type": "object", "properties": {}},
        },
    ]

    def setup(self, rng: random.Random) -> None:
        slots: dict[str, dict[str, Any]] = {}
        for doctor in DOCTORS:
            for day in DAYS:
                for time in rng.sample(TIMES, 5):
                    slots[f"S{len(slots) + 1:03d}"] = {"doctor": doctor, "day": day, "time": time, "free": True}
        for slot in rng.sample(sorted(slots), 40):
            slots[slot]["free"] = False
        patients: dict[str, dict[str, Any]] = {}
        for name in rng.sample(PATIENTS, 3):
            patients[f"P{100 + len(patients)}"] = {"name": name, "phone": f"555-{rng.randint(1000, 9999)}"}
        self.person: dict[str, Any] = {
            "name": rng.choice([p for p in PATIENTS if p not in {v["name"] for v in patients.values()}]),
            "phone": f"555-{rng.randint(1000, 9999)}",
            "insurance": {"provider": rng.choice(INSURERS), "member_id": f"M{rng.randint(100000, 999999)}"},
        }
        while True:
            self.doctor, self.day = rng.choice(DOCTORS), rng.choice(DAYS)
            free = [s for s, v in slots.items() if v["doctor"] == self.doctor and v["day"] == self.day and v["free"]]
            if len(free) >= 2:
                break
        self.slot = min(free, key=lambda s: slots[s]["time"])
        self.reason = rng.choice(REASONS)
        self.hours = rng.choice([12, 24, 48])
        self.patient_id = f"P{100 + len(patients)}"  # ids are sequential, so the solution can name them
        self.appointment_id = "A1"
        self.state = {"slots": slots, "patients": patients, "appointments": {}, "searches": [], "reminders": {}}
        p = self.person
        self.instructions = [
            f"Hello, I'm new here. Please register me: {p['name']}, phone {p['phone']}, insured with "
            f"{p['insurance']['provider']} (member id {p['insurance']['member_id']}).",
            f"Which slots does {self.doctor} have free on {self.day}?",
            f"Book me the earliest of those slots, for a {self.reason.replace('_', ' ')}.",
            f"Please remind me by sms and by email, {self.hours} hours before.",
        ]
        person, pid, slot, reason = dict(p), self.patient_id, self.slot, self.reason
        doctor, day, aid, hours = self.doctor, self.day, self.appointment_id, self.hours
        self.criteria = [
            lambda s: s["patients"].get(pid) == person,
            lambda s: [doctor, day] in s["searches"],
            lambda s: s["appointments"].get(aid) == {"patient_id": pid, "slot_id": slot, "reason": reason},
            lambda s: s["reminders"].get(aid) == {"channels": ["email", "sms"], "hours_before": hours},
        ]

    def tool_register_patient(self, patient: dict[str, Any]) -> dict[str, str] | str:
        for pid, known in self.state["patients"].items():
            if known["name"] == patient["name"] and known["phone"] == patient["phone"]:
                return f"{patient['name']} is already registered as {pid}."
        pid = f"P{100 + len(self.state['patients'])}"
        self.state["patients"][pid] = {
            "name": patient["name"],
            "phone": patient["phone"],
            "insurance": dict(patient["insurance"]),
        }
        return {"patient_id": pid}

    def tool_search_slots(self, doctor: str, day: str) -> list[dict[str, str]] | str:
        if doctor not in DOCTORS:
            return f"Unknown doctor {doctor!r}. Doctors: {', '.join(DOCTORS)}."
        self.state["searches"].append([doctor, day])
        free = [
            {"slot_id": s, "time": v["time"]}
            for s, v in sorted(self.state["slots"].items(), key=lambda kv: kv[1]["time"])
            if v["doctor"] == doctor and v["day"] == day and v["free"]
        ]
        return free or f"{doctor} has no free slots on {day}."

    def tool_book_appointment(self, patient_id: str, slot_id: str, reason: str) -> dict[str, str] | str:
        if patient_id not in self.state["patients"]:
            raise KeyError(f"unknown patient {patient_id!r}; register the patient first")
        slot = self.state["slots"].get(slot_id)
        if slot is None or not slot["free"]:
            return f"Slot {slot_id} is not free."
        slot["free"] = False
        aid = f"A{len(self.state['appointments']) + 1}"
        self.state["appointments"][aid] = {"patient_id": patient_id, "slot_id": slot_id, "reason": reason}
        return {"appointment_id": aid, "doctor": slot["doctor"], "day": slot["day"], "time": slot["time"]}

    def tool_send_reminder(self, appointment_id: str, channels: list[str], hours_before: int) -> str:
        if appointment_id not in self.state["appointments"]:
            raise KeyError(f"unknown appointment {appointment_id!r}")
        self.state["reminders"][appointment_id] = {"channels": sorted(set(channels)), "hours_before": hours_before}
        return f"Reminder set for {appointment_id} via {', '.join(sorted(set(channels)))}, {hours_before} h before."

    def tool_cancel_appointment(self, appointment_id: str) -> str:
        appointment = self.state["appointments"].pop(appointment_id, None)
        if appointment is None:
            return f"No appointment {appointment_id!r}."
        self.state["slots"][appointment["slot_id"]]["free"] = True
        return f"Appointment {appointment_id} cancelled."

    def tool_get_clinic_news(self) -> str:
        return "The clinic is closed on public holidays. Flu vaccines are available from October."

    def solution(self) -> list[list[dict[str, Any]]]:
        return [
            [{"name": "register_patient", "arguments": {"patient": self.person}}],
            [{"name": "search_slots", "arguments": {"doctor": self.doctor, "day": self.day}}],
            [
                {
                    "name": "book_appointment",
                    "arguments": {"patient_id": self.patient_id, "slot_id": self.slot, "reason": self.reason},
                }
            ],
            [
                {
                    "name": "send_reminder",
                    "arguments": {
                        "appointment_id": self.appointment_id,
                        "channels": ["sms", "email"],
                        "hours_before": self.hours,
                    },
                }
            ],
        ]
