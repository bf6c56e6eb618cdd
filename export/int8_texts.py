"""A fixed, varied set of texts on which a quantized graph must agree with fp32.

Fixed so that two exports, or an export and a test, measure the same thing; varied
(short and long, punctuation, numbers, non-English, code, noise) because int8 error
shows up where activations are unusual, not on the average English sentence.
"""

_SHORT = (
    "Hi.",
    "ok",
    "Yes!",
    "Why?",
    "Thanks a lot :)",
    "The cat sat on the mat.",
    "A man is playing a guitar.",
    "Stock markets fell sharply on Monday.",
    "Where is the nearest train station?",
    "I can't believe it's not butter!!!",
)

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Self-attention lets every token look at every other token in the sequence.",
    "Please reset my password; I no longer have access to the old e-mail address.",
    "The meeting was moved from 3:30 p.m. to 10:15 a.m. on 2024-03-07.",
    "Order #48213 shipped on 12/05 — tracking: 1Z999AA10123456784, ETA 3–5 days.",
    "Pi is approximately 3.14159265358979, and e is about 2.71828.",
    "In 1969, Apollo 11 landed on the Moon with 3 astronauts aboard.",
    "Revenue grew 17.5% year over year to $4.2 billion, beating estimates by 0.3%.",
    "Temperature: -40 °C equals -40 °F; water boils at 100 °C (212 °F) at sea level.",
    "Call +1 (555) 010-9999 or write to support@example.com before 5 pm.",
    "\"Well,\" she said, \"that's... unexpected?!\" — and left (quietly).",
    "Wait—what?! No, no, NO: this can't be right... can it?",
    "### WARNING ### Do NOT unplug the device while updating!!!",
    "Le chat dort sur le canapé pendant que la pluie tombe doucement.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "¿Dónde está la biblioteca? Necesito devolver tres libros hoy.",
    "Il treno per Milano parte alle otto e quarantacinque.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "東京は日本の首都であり、世界最大の都市圏の一つです。",
    "我今天早上喝了一杯咖啡，然后去上班。",
    "서울은 대한민국의 수도입니다.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "العربية لغة جميلة وغنية بالمفردات.",
    "यह एक परीक्षण वाक्य है।",
    "def add(a: int, b: int) -> int:\n    return a + b",
    "for (int i = 0; i < n; ++i) { sum += x[i] * w[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;",
    "import numpy as np; x = np.zeros((32, 512), dtype=np.float32)",
    "git commit -m 'fix: handle empty batch' && git push origin main",
    "{\"id\": 17, \"tags\": [\"a\", \"b\"], \"active\": true, \"score\": 0.93}",
    "<div class=\"header\"><a href=\"/home\">Home</a></div>",
    "https://example.org/path/to/page?query=attention&lang=en#section-2",
    "ERROR 2024-01-01T00:00:00Z worker-3 Traceback (most recent call last): KeyError: 'id'",
    "lol idk tbh 🤷‍♂️ see u l8r 👋🎉",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Mitochondria are the membrane-bound organelles that generate most of the cell's ATP.",
    "The defendant's motion for summary judgment is hereby DENIED in its entirety.",
    "Take 2 tablets (500 mg each) every 6 hours; do not exceed 4 g per day.",
    "To be, or not to be, that is the question.",
)

_PARAGRAPH = (
    "Transformers process a sequence by letting every position attend to every other "
    "position, weighting the values by the softmax of scaled dot products between queries "
    "and keys. Because the cost of that grows with the square of the length, long inputs "
    "are where memory and latency are decided, and where a server must plan carefully. "
)
_MIXED = (
    "Invoice 2023/117: 14 × widgets @ €3.50 = €49.00; shipping €7.25; total €56.25 (VAT 21%). "
    "Contact: Müller GmbH, Straße des 17. Juni 135, 10623 Berlin. "
)
_CODE = (
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n"
    "    def get(self, key):\n        return self.items.get(key)\n"
)
_MULTILINGUAL = (
    "English text, then français avec des accents, dann ein deutscher Satz, "
    "потом немного по-русски, そして日本語も少し。 "
)

# Long texts reach the lengths where the batched server spends most of its time (about
# 60 to 500 tokens); all stay under MiniLM's 512 positions.
_LONG = (
    _PARAGRAPH,
    _PARAGRAPH * 2,
    _PARAGRAPH * 5,
    _MIXED * 3,
    _MIXED * 8,
    _CODE * 3,
    _CODE * 6,
    _MULTILINGUAL * 4,
    " ".join(_SENTENCES[:12]),
    " ".join(_SENTENCES[12:24]),
    " ".join(_SENTENCES[24:36]),
)

PARITY_TEXTS: tuple[str, ...] = _SHORT + _SENTENCES + _LONG

# Separate from PARITY_TEXTS, so the parity a manifest records is measured on texts the
# quantizer's calibration never saw.
CALIBRATION_TEXTS: tuple[str, ...] = (
    "Good morning!",
    "What time does the store open tomorrow?",
    "A woman is slicing an onion in the kitchen.",
    "The committee approved the budget after a long debate.",
    "Neural networks learn representations from data.",
    "Version 2.3.1 fixes a crash when the file is empty (see issue #512).",
    "Our flight departs at 06:40 and lands at 09:15 local time, 1,250 km later.",
    "Sales rose 8% to 12.4 million units in Q3 2023.",
    "She asked: \"Is this seat taken?\" He said no.",
    "Beware!!! The floor is wet... watch your step; seriously.",
    "Les enfants jouent dans le parc après l'école.",
    "Ich habe heute keine Zeit, vielleicht morgen.",
    "El mercado abre los sábados a las nueve de la mañana.",
    "Сегодня идёт снег, и дороги очень скользкие.",
    "今日はとても暑いので、冷たい飲み物がほしいです。",
    "他正在图书馆里学习数学。",
    "while queue:\n    node = queue.pop()\n    visit(node)",
    "const total = items.reduce((acc, x) => acc + x.price, 0);",
    "UPDATE accounts SET balance = balance - 100 WHERE id = 42;",
    "$ docker run --rm -p 8080:80 nginx:latest",
    "WARN 12:01:07 disk usage at 91% on /var/lib",
    "gr8 game last nite!! 😂😂 cant wait 4 the next 1",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The tenant shall pay rent on the first day of each calendar month.",
    " ".join(("Attention maps show which tokens a model looked at when it built each "
              "representation, and they can be averaged over heads or layers.",) * 4),
    " ".join(("Numbers such as 3.5, 1e-4, 42, and -17 appear in tables, logs, and receipts; "
              "models must read them in context.",) * 6),
    " ".join(("def f(x):\n    return x * 2\n",) * 10),
    " ".join(("Der Zug hat Verspätung. Le train est en retard. The train is late. "
              "列车晚点了。",) * 5),
)
