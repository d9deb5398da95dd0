"""The fixed texts whose embeddings set each model's int8/uint8 scale (``api/int8_scale.py``).

Part of the quantized format: changing a text changes every model's int8 vectors, so these
stay as they are. They are mixed on purpose (questions and passages, prose, lists, code,
numbers, several languages and scripts, one word and a paragraph) so that the largest
component they reach is near the largest that ordinary inputs reach.
"""

CALIBRATION_TEXTS: tuple[str, ...] = (
    "How do I reset my password?",
    "What is the capital of Australia?",
    "best hiking trails near Lake Geneva",
    "Why is the sky blue during the day and red at sunset?",
    "symptoms of vitamin D deficiency in adults",
    "cheap flights from Madrid to Lisbon in March",
    "Who wrote the novel One Hundred Years of Solitude?",
    "how many tablespoons in a cup",
    "The mitochondrion is the organelle in which most of a cell's ATP is made by oxidative "
    "phosphorylation.",
    "Photosynthesis turns carbon dioxide and water into glucose and oxygen, using the energy of "
    "sunlight captured by chlorophyll.",
    "The Treaty of Westphalia, signed in 1648, ended the Thirty Years' War and shaped the idea "
    "of state sovereignty in Europe.",
    "Interest rates rose for the third consecutive quarter as the central bank tried to bring "
    "inflation back towards its two percent target.",
    "Our return policy allows customers to send back unused items within thirty days of "
    "delivery for a full refund.",
    "The patient was admitted with shortness of breath, a persistent cough and a fever of 38.9 "
    "degrees.",
    "Preheat the oven to 200 degrees, slice the potatoes thinly and roast them with olive oil, "
    "garlic and rosemary for forty minutes.",
    "The striker scored twice in the second half, and the home side won the cup final three "
    "goals to one.",
    "A transformer encoder maps a sequence of tokens to contextual vectors with self-attention "
    "and feed-forward layers.",
    "Gradient descent updates each parameter in the direction that most reduces the loss, "
    "scaled by the learning rate.",
    "The tenant must give written notice at least two months before the end of the lease.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level.",
    "The museum's new wing houses impressionist paintings and a collection of Japanese prints.",
    "She opened the letter slowly, afraid of what it might say, and read it twice before "
    "she sat down.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "The quarterly report shows revenue of $4.2 million, up 12% year over year, with operating "
    "costs flat.",
    "Error: connection refused while connecting to upstream on port 5432.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    "
    "return a",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10;",
    "git rebase --interactive HEAD~3",
    "Ingredients: 2 eggs, 250 g flour, 500 ml milk, a pinch of salt.",
    "Monday 09:00 team meeting; Tuesday 14:30 dentist; Friday 18:00 dinner with Ana.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89",
    "ISBN 978-0-306-40615-7",
    "Thanks so much!! Loved it :)",
    "terrible service, never again",
    "The product arrived damaged and customer support never answered my emails.",
    "Absolutely fantastic hotel: friendly staff, spotless rooms and a great breakfast.",
    "Is this email spam? You have won a free cruise, click the link to claim your prize.",
    "Neural networks",
    "photosynthesis",
    "Paris",
    "ok",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Wie spät ist es, und wann fährt der nächste Zug nach Berlin?",
    "Le chat dort sur le canapé pendant que la pluie tombe sur la ville.",
    "Quelle est la meilleure façon d'apprendre une nouvelle langue ?",
    "El museo del Prado alberga una de las colecciones de arte europeo más importantes del mundo.",
    "¿Dónde está la estación de tren más cercana?",
    "A fotossíntese é o processo pelo qual as plantas produzem o seu alimento.",
    "Il governo ha approvato una nuova legge sull'energia rinnovabile.",
    "De trein naar Amsterdam vertrekt elk half uur vanaf spoor vier.",
    "Москва — столица и крупнейший город России.",
    "Сколько стоит билет на концерт в субботу?",
    "东京是日本的首都，也是世界上人口最多的城市之一。",
    "如何学习机器学习？",
    "今日はとても良い天気ですね。",
    "서울은 대한민국의 수도입니다.",
    "القاهرة هي عاصمة مصر وأكبر مدنها.",
    "हिमालय दुनिया की सबसे ऊँची पर्वत श्रृंखला है।",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "İstanbul, Avrupa ile Asya arasında yer alan bir şehirdir.",
    "Hà Nội là thủ đô của Việt Nam.",
    "The committee reviewed the proposal in detail. After a long discussion about costs, "
    "timelines and the risks to existing services, it decided to fund a smaller pilot first "
    "and to revisit the full plan once the pilot's results are known next spring.",
    "Climate change is altering rainfall patterns across the world. Some regions face longer "
    "droughts while others see heavier floods, and farmers must adapt the crops they grow and "
    "the way they manage water to keep their harvests stable.",
    "To install the package, create a virtual environment, activate it, and run pip install "
    "with the name of the package; then import it in Python and call its main function with "
    "the path of your input file.",
)
