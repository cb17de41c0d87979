package arealagents;

import java.util.ArrayList;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A small, strict JSON (RFC 8259) parser and writer, so the SDK needs nothing beyond the JDK.
 *
 * <p>Parsing maps objects to {@code LinkedHashMap<String,Object>}, arrays to {@code List<Object>}, integral numbers to
 * {@code Long} (to {@code Double} past Long's range), other numbers to {@code Double}, and true/false/null to
 * Boolean/null. Writing accepts those types plus any Map, Iterable, Number, int[]/long[]/double[] and Object[].
 */
public final class Json {
    /** Deeper nesting is refused, so a hostile body cannot overflow the parser's stack. */
    public static final int MAX_DEPTH = 512;

    /** Malformed JSON; the message names the character position where parsing stopped. */
    public static final class ParseException extends IllegalArgumentException {
        public final int position;

        ParseException(String message, int position) {
            super(message + " at position " + position);
            this.position = position;
        }
    }

    private final String text;
    private int pos;

    private Json(String text) {
        this.text = text;
    }

    /** The value of one JSON document; whitespace around it is allowed, anything else is a ParseException. */
    public static Object parse(String text) {
        Json p = new Json(text);
        Object value = p.value(0);
        p.skipSpace();
        if (p.pos != text.length()) throw p.error("unexpected text after the JSON value");
        return value;
    }

    /** Compact JSON text of {@code value}; non-finite doubles and unknown types are IllegalArgumentException. */
    public static String write(Object value) {
        StringBuilder out = new StringBuilder();
        write(value, out);
        return out.toString();
    }

    // -- parser -------------------------------------------------------------------------------------

    private ParseException error(String message) {
        return new ParseException(message, pos);
    }

    private void skipSpace() {
        while (pos < text.length() && " \t\r\n".indexOf(text.charAt(pos)) >= 0) pos++;
    }

    private Object value(int depth) {
        if (depth > MAX_DEPTH) throw error("nesting deeper than " + MAX_DEPTH);
        skipSpace();
        if (pos >= text.length()) throw error("unexpected end of input");
        char c = text.charAt(pos);
        switch (c) {
            case '{': return object(depth);
            case '[': return array(depth);
            case '"': return string();
            case 't': return literal("true", Boolean.TRUE);
            case 'f': return literal("false", Boolean.FALSE);
            case 'n': return literal("null", null);
            default:
                if (c == '-' || (c >= '0' && c <= '9')) return number();
                throw error("unexpected character '" + c + "'");
        }
    }

    private Object literal(String word, Object value) {
        if (!text.startsWith(word, pos)) throw error("expected " + word);
        pos += word.length();
        return value;
    }

    private Map<String, Object> object(int depth) {
        Map<String, Object> map = new LinkedHashMap<>();
        pos++; // '{'
        skipSpace();
        if (peek() == '}') { pos++; return map; }
        while (true) {
            skipSpace();
            if (peek() != '"') throw error("expected a string key");
            String key = string();
            skipSpace();
            expect(':');
            map.put(key, value(depth + 1));
            skipSpace();
            if (peek() == ',') { pos++; continue; }
            expect('}');
            return map;
        }
    }

    private List<Object> array(int depth) {
        List<Object> list = new ArrayList<>();
        pos++; // '['
        skipSpace();
        if (peek() == ']') { pos++; return list; }
        while (true) {
            list.add(value(depth + 1));
            skipSpace();
            if (peek() == ',') { pos++; continue; }
            expect(']');
            return list;
        }
    }

    private char peek() {
        return pos < text.length() ? text.charAt(pos) : '\0';
    }

    private void expect(char c) {
        if (peek() != c) throw pos < text.length() ? error("expected '" + c + "'") : error("unexpected end of input");
        pos++;
    }

    private String string() {
        StringBuilder out = new StringBuilder();
        pos++; // opening quote
        while (true) {
            if (pos >= text.length()) throw error("unterminated string");
            char c = text.charAt(pos++);
            if (c == '"') return out.toString();
            if (c < 0x20) { pos--; throw error("control character in string"); }
            if (c != '\\') { out.append(c); continue; }
            if (pos >= text.length()) throw error("unterminated string");
            char e = text.charAt(pos++);
            switch (e) {
                case '"': case '\\': case '/': out.append(e); break;
                case 'b': out.append('\b'); break;
                case 'f': out.append('\f'); break;
                case 'n': out.append('\n'); break;
                case 'r': out.append('\r'); break;
                case 't': out.append('\t'); break;
                case 'u': out.append(hex4()); break; // a surrogate pair is two escapes, joined by the UTF-16 string
                default: pos--; throw error("bad escape '\\" + e + "'");
            }
        }
    }

    private char hex4() {
        if (pos + 4 > text.length()) throw error("truncated \\u escape");
        int code = 0;
        for (int i = 0; i < 4; i++) {
            int digit = Character.digit(text.charAt(pos), 16);
            if (digit < 0) throw error("bad hex digit in \\u escape");
            code = code * 16 + digit;
            pos++;
        }
        return (char) code;
    }

    private Object number() {
        int start = pos;
        if (peek() == '-') pos++;
        if (peek() == '0') pos++;
        else if (!digits()) throw error("expected a digit");
        boolean integral = true;
        if (peek() == '.') { pos++; integral = false; if (!digits()) throw error("expected a digit after '.'"); }
        if (peek() == 'e' || peek() == 'E') {
            pos++;
            integral = false;
            if (peek() == '+' || peek() == '-') pos++;
            if (!digits()) throw error("expected a digit in the exponent");
        }
        String literal = text.substring(start, pos);
        if (integral) {
            try {
                return Long.parseLong(literal);
            } catch (NumberFormatException tooBig) {
                return Double.parseDouble(literal);
            }
        }
        return Double.parseDouble(literal);
    }

    private boolean digits() {
        int start = pos;
        while (pos < text.length() && text.charAt(pos) >= '0' && text.charAt(pos) <= '9') pos++;
        return pos > start;
    }

    // -- writer -------------------------------------------------------------------------------------

    private static void write(Object v, StringBuilder out) {
        if (v == null) out.append("null");
        else if (v instanceof String s) quote(s, out);
        else if (v instanceof Boolean b) out.append(b);
        else if (v instanceof Double || v instanceof Float) number(((Number) v).doubleValue(), out);
        else if (v instanceof Number n) out.append(n.longValue());
        else if (v instanceof Map<?, ?> m) object(m, out);
        else if (v instanceof Iterable<?> it) array(it.iterator(), out);
        else if (v instanceof Object[] a) array(List.of(a).iterator(), out);
        else if (v instanceof int[] a) array(java.util.Arrays.stream(a).boxed().iterator(), out);
        else if (v instanceof long[] a) array(java.util.Arrays.stream(a).boxed().iterator(), out);
        else if (v instanceof double[] a) array(java.util.Arrays.stream(a).boxed().iterator(), out);
        else throw new IllegalArgumentException("cannot write a " + v.getClass().getName() + " as JSON");
    }

    private static void number(double d, StringBuilder out) {
        if (!Double.isFinite(d)) throw new IllegalArgumentException("JSON has no " + d + " (a non-finite number)");
        out.append(d);
    }

    private static void object(Map<?, ?> map, StringBuilder out) {
        out.append('{');
        boolean first = true;
        for (Map.Entry<?, ?> e : map.entrySet()) {
            if (!(e.getKey() instanceof String key)) throw new IllegalArgumentException("JSON keys are strings");
            if (!first) out.append(',');
            first = false;
            quote(key, out);
            out.append(':');
            write(e.getValue(), out);
        }
        out.append('}');
    }

    private static void array(Iterator<?> items, StringBuilder out) {
        out.append('[');
        for (boolean first = true; items.hasNext(); first = false) {
            if (!first) out.append(',');
            write(items.next(), out);
        }
        out.append(']');
    }

    private static void quote(String s, StringBuilder out) {
        out.append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': out.append("\\\""); break;
                case '\\': out.append("\\\\"); break;
                case '\n': out.append("\\n"); break;
                case '\r': out.append("\\r"); break;
                case '\t': out.append("\\t"); break;
                default:
                    if (c < 0x20 || c == 0x2028 || c == 0x2029 || Character.isSurrogate(c) && !pairedSurrogate(s, i)) {
                        out.append(String.format("\\u%04x", (int) c)); // also safe for JavaScript; lone surrogates kept
                    } else {
                        out.append(c);
                    }
            }
        }
        out.append('"');
    }

    /** Whether the surrogate at {@code i} is half of a well-formed pair (then it is written as UTF-8 text). */
    private static boolean pairedSurrogate(String s, int i) {
        char c = s.charAt(i);
        if (Character.isHighSurrogate(c)) return i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1));
        return i > 0 && Character.isHighSurrogate(s.charAt(i - 1));
    }
}
