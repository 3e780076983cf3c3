package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"reflect"
	"strings"
	"unicode/utf8"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// maxEchoedKey bounds how much of an offending JSON key is echoed back.
const maxEchoedKey = 64

// DecodeJSON reads a JSON request body into dst, which must point to a
// struct with flat json tags. It answers *broker.Error values: 415 for a
// Content-Type other than application/json, 413 over limit bytes, 400 for
// an empty, malformed, non-object, duplicate-key, unknown-key or trailing
// body. The body must already be wrapped by http.MaxBytesReader.
func DecodeJSON(r *http.Request, limit int64, dst any) error {
	if err := checkJSONContentType(r.Header.Get("Content-Type")); err != nil {
		return err
	}
	if r.ContentLength > limit {
		return tooLarge(limit)
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return tooLarge(mbe.Limit)
		}
		return problem.Wrap(problem.KindInvalid, "The request body could not be read.", err)
	}
	return decodeStrict(body, dst)
}

// ReadJWKS reads a key set upload: application/json or
// application/jwk-set+json, at most limit bytes. The document's shape is
// the broker's to check (pki.ParseJWKS); keys carry members no struct lists.
func ReadJWKS(r *http.Request, limit int64) ([]byte, error) {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || (mt != apiv1.MediaTypeJSON && mt != apiv1.MediaTypeJWKSet) {
		return nil, problem.Errorf(problem.KindUnsupportedMediaType, "The request body must be application/json or application/jwk-set+json.")
	}
	if r.ContentLength > limit {
		return nil, tooLarge(limit)
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, tooLarge(mbe.Limit)
		}
		return nil, problem.Wrap(problem.KindInvalid, "The request body could not be read.", err)
	}
	if int64(len(body)) > limit {
		return nil, tooLarge(limit)
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, problem.Errorf(problem.KindInvalid, "The request body is empty.")
	}
	return body, nil
}

func tooLarge(limit int64) error {
	return problem.Errorf(problem.KindTooLarge, "The request body is larger than %d bytes.", limit)
}

// checkJSONContentType accepts application/json with at most a UTF-8
// charset parameter.
func checkJSONContentType(ct string) error {
	unsupported := problem.Errorf(problem.KindUnsupportedMediaType, "The request body must be application/json.")
	if ct == "" {
		return unsupported
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != apiv1.MediaTypeJSON {
		return unsupported
	}
	for k, v := range params {
		if k != "charset" || !strings.EqualFold(v, "utf-8") {
			return unsupported
		}
	}
	return nil
}

// decodeStrict decodes body, which must be exactly one JSON object whose
// keys are each, exactly and once, a json name of dst's struct.
//
// encoding/json alone matches keys case-insensitively (so "NAMESPACE", or
// "ſerviceAccount" with a long s, would be taken as known fields), lets a
// repeated key silently win, and ignores what follows the first value; the
// key scan closes those gaps before the real decode.
func decodeStrict(body []byte, dst any) error {
	if len(bytes.TrimSpace(body)) == 0 {
		return problem.Errorf(problem.KindInvalid, "The request body is empty.")
	}
	if err := scanObjectKeys(body, FieldNames(dst)); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return decodeError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return problem.Errorf(problem.KindInvalid, "The request body has data after the JSON object.")
	}
	return nil
}

// scanObjectKeys checks, token by token, that body is one well-formed JSON
// object with known, unique top-level keys and nothing after it.
func scanObjectKeys(body []byte, known map[string]bool) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return decodeError(err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return problem.Errorf(problem.KindInvalid, "The request body must be a JSON object.")
	}
	seen := make(map[string]bool, len(known))
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return decodeError(err)
		}
		key, ok := tok.(string)
		if !ok {
			return problem.Errorf(problem.KindInvalid, "The request body is not valid JSON.")
		}
		if !known[key] {
			return problem.Invalid(apiv1.FieldError{Field: EchoKey(key), Detail: "unknown field"})
		}
		if seen[key] {
			return problem.Invalid(apiv1.FieldError{Field: key, Detail: "duplicate field"})
		}
		seen[key] = true
		if err := skipValue(dec); err != nil {
			return err
		}
	}
	if _, err := dec.Token(); err != nil { // the closing '}'
		return decodeError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return problem.Errorf(problem.KindInvalid, "The request body has data after the JSON object.")
	}
	return nil
}

// skipValue consumes one JSON value, however deeply nested.
func skipValue(dec *json.Decoder) error {
	depth := 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return decodeError(err)
		}
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{', '[':
				depth++
			case '}', ']':
				depth--
			}
		}
		if depth == 0 {
			return nil
		}
	}
}

// decodeError turns an encoding/json error into a caller-safe 400.
func decodeError(err error) error {
	var (
		syntaxErr *json.SyntaxError
		typeErr   *json.UnmarshalTypeError
	)
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return problem.Wrap(problem.KindInvalid, "The request body is truncated JSON.", err)
	case errors.As(err, &syntaxErr):
		return problem.Wrap(problem.KindInvalid,
			fmt.Sprintf("The request body is not valid JSON (at byte %d).", syntaxErr.Offset), err)
	case errors.As(err, &typeErr):
		field := typeErr.Field
		if field == "" {
			field = "(body)"
		}
		return &problem.Error{
			Kind:   problem.KindInvalid,
			Detail: "The request is invalid.",
			Fields: []apiv1.FieldError{{Field: EchoKey(field), Detail: "must be " + jsonTypeName(typeErr.Type)}},
			Err:    err,
		}
	default:
		// DisallowUnknownFields and other decoder complaints; the key scan
		// normally catches unknown fields first.
		return problem.Wrap(problem.KindInvalid, "The request body does not match the expected object.", err)
	}
}

func jsonTypeName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "an array of " + strings.TrimPrefix(strings.TrimPrefix(jsonTypeName(t.Elem()), "a "), "an ") + "s"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		return "a number"
	default:
		return "an object"
	}
}

// EchoKey makes a client-supplied key or id safe and short enough to show back.
func EchoKey(k string) string {
	k = strings.ToValidUTF8(k, "\uFFFD")
	if len(k) <= maxEchoedKey {
		return k
	}
	cut := maxEchoedKey
	for cut > 0 && !utf8.RuneStart(k[cut]) {
		cut--
	}
	return k[:cut] + "…"
}

// FieldNames returns the json names of the exported fields of the
// struct dst points to: the keys DecodeJSON accepts for it.
func FieldNames(dst any) map[string]bool {
	t := reflect.TypeOf(dst)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	names := make(map[string]bool, t.NumField())
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch name {
		case "-":
			continue
		case "":
			name = f.Name
		}
		names[name] = true
	}
	return names
}
