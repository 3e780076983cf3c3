package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
)

// Bounds of a JSON Web Key Set (RFC 7517) as the broker accepts one: a
// Kubernetes cluster publishes one key per --service-account-key-file entry,
// so a handful of keys in a few KiB is normal and the limits are generous.
const (
	// MaxJWKSBytes bounds a JWKS document (an upload, a jwksFile).
	MaxJWKSBytes = 64 << 10
	// MaxJWKSKeys bounds the keys of one set.
	MaxJWKSKeys = 16
	// maxKeyIDLen bounds a key id.
	maxKeyIDLen = 128
)

// JWKS is a parsed, validated key set of service-account token verification
// keys: RSA keys (for RS256) of 2048 to 8192 bits and ECDSA P-256 keys (for
// ES256), each with a unique key id. It is immutable.
type JWKS struct {
	keys   map[string]crypto.PublicKey
	algs   map[string]string
	kids   []string
	digest string
}

// jwk is the part of a JSON Web Key that a verification key needs. Other
// members (x5c, key_ops…) are ignored, as RFC 7517 asks of unknown ones.
type jwk struct {
	Kty string `json:"kty"`
	Kid string `json:"kid"`
	Use string `json:"use"`
	Alg string `json:"alg"`
	N   string `json:"n"`
	E   string `json:"e"`
	Crv string `json:"crv"`
	X   string `json:"x"`
	Y   string `json:"y"`
	// D is a private key member: a set that carries one is refused, so
	// that a private key pasted by mistake is never stored.
	D string `json:"d"`
}

// ParseJWKS parses and validates a JWKS document, as a cluster serves it at
// /openid/v1/jwks. Every key must be usable (an RSA or EC P-256 public key
// for signatures, with a key id); one that is not makes the whole set
// invalid, so that a set is never half-used. Errors name the key by index
// and never hold key material.
func ParseJWKS(data []byte) (*JWKS, error) {
	if len(data) > MaxJWKSBytes {
		return nil, fmt.Errorf("JWKS is %d bytes, over the limit of %d", len(data), MaxJWKSBytes)
	}
	var doc struct {
		Keys []json.RawMessage `json:"keys"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("JWKS is not a JSON object with a keys array: %w", err)
	}
	if dec.More() {
		return nil, errors.New("JWKS has data after the JSON object")
	}
	if len(doc.Keys) == 0 {
		return nil, errors.New("JWKS has no keys")
	}
	if len(doc.Keys) > MaxJWKSKeys {
		return nil, fmt.Errorf("JWKS has %d keys, over the limit of %d", len(doc.Keys), MaxJWKSKeys)
	}
	s := &JWKS{keys: map[string]crypto.PublicKey{}, algs: map[string]string{}}
	h := sha256.New()
	for i, raw := range doc.Keys {
		var k jwk
		if err := json.Unmarshal(raw, &k); err != nil {
			return nil, fmt.Errorf("keys[%d]: not a JSON Web Key: %w", i, err)
		}
		pub, alg, err := k.publicKey()
		if err != nil {
			return nil, fmt.Errorf("keys[%d]: %w", i, err)
		}
		if k.Kid == "" || len(k.Kid) > maxKeyIDLen || !printable(k.Kid) {
			return nil, fmt.Errorf("keys[%d]: kid must be 1 to %d printable ASCII characters", i, maxKeyIDLen)
		}
		if _, dup := s.keys[k.Kid]; dup {
			return nil, fmt.Errorf("keys[%d]: duplicate kid %q", i, k.Kid)
		}
		s.keys[k.Kid], s.algs[k.Kid] = pub, alg
		s.kids = append(s.kids, k.Kid)
	}
	slices.Sort(s.kids)
	for _, kid := range s.kids {
		der, err := x509.MarshalPKIXPublicKey(s.keys[kid])
		if err != nil {
			return nil, fmt.Errorf("kid %q: %w", kid, err)
		}
		fmt.Fprintf(h, "%d:%s%d:", len(kid), kid, len(der))
		h.Write(der)
	}
	s.digest = "sha256:" + hex.EncodeToString(h.Sum(nil))
	return s, nil
}

func (k *jwk) publicKey() (crypto.PublicKey, string, error) {
	if k.D != "" {
		return nil, "", errors.New("holds a private key (member d): publish only public keys")
	}
	if k.Use != "" && k.Use != "sig" {
		return nil, "", fmt.Errorf("use %q: only signature keys (sig) verify tokens", k.Use)
	}
	switch k.Kty {
	case "RSA":
		if k.Alg != "" && k.Alg != "RS256" {
			return nil, "", fmt.Errorf("alg %q: RSA keys are accepted for RS256 only", k.Alg)
		}
		n, err := b64uint(k.N, maxRSABits/8)
		if err != nil {
			return nil, "", fmt.Errorf("n: %w", err)
		}
		e, err := b64uint(k.E, 4)
		if err != nil {
			return nil, "", fmt.Errorf("e: %w", err)
		}
		if bits := n.BitLen(); bits < minRSABits || bits > maxRSABits {
			return nil, "", fmt.Errorf("RSA key of %d bits: %d to %d are accepted", bits, minRSABits, maxRSABits)
		}
		if !e.IsInt64() || e.Int64() < 3 || e.Int64()%2 == 0 || e.Int64() > 1<<31-1 {
			return nil, "", errors.New("e: not a usable RSA public exponent")
		}
		return &rsa.PublicKey{N: n, E: int(e.Int64())}, "RS256", nil
	case "EC":
		if k.Alg != "" && k.Alg != "ES256" {
			return nil, "", fmt.Errorf("alg %q: EC keys are accepted for ES256 only", k.Alg)
		}
		if k.Crv != "P-256" {
			return nil, "", fmt.Errorf("crv %q: only P-256 (ES256) is accepted", k.Crv)
		}
		x, errX := base64.RawURLEncoding.Strict().DecodeString(k.X)
		y, errY := base64.RawURLEncoding.Strict().DecodeString(k.Y)
		if errX != nil || errY != nil || len(x) != 32 || len(y) != 32 {
			return nil, "", errors.New("x and y must be 32-byte base64url coordinates")
		}
		// The parser checks that the point is on the curve.
		pub, err := ecdsa.ParseUncompressedPublicKey(elliptic.P256(), append(append([]byte{4}, x...), y...))
		if err != nil {
			return nil, "", errors.New("x, y is not a point of P-256")
		}
		return pub, "ES256", nil
	case "":
		return nil, "", errors.New("kty is required")
	default:
		return nil, "", fmt.Errorf("kty %q: only RSA (RS256) and EC P-256 (ES256) keys are accepted", k.Kty)
	}
}

// b64uint decodes an unsigned big-endian integer in base64url without
// padding, of at most maxBytes bytes and without leading zero bytes.
func b64uint(s string, maxBytes int) (*big.Int, error) {
	if s == "" {
		return nil, errors.New("is required")
	}
	if len(s) > base64.RawURLEncoding.EncodedLen(maxBytes) {
		return nil, errors.New("is too long")
	}
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil {
		return nil, errors.New("is not base64url without padding")
	}
	if len(b) == 0 || b[0] == 0 {
		return nil, errors.New("is not a minimal unsigned integer")
	}
	return new(big.Int).SetBytes(b), nil
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// Key returns the key with the given id and the one algorithm it verifies
// (RS256 or ES256).
func (s *JWKS) Key(kid string) (crypto.PublicKey, string, bool) {
	if s == nil {
		return nil, "", false
	}
	k, ok := s.keys[kid]
	return k, s.algs[kid], ok
}

// KeyIDs returns the key ids, sorted.
func (s *JWKS) KeyIDs() []string {
	if s == nil {
		return nil
	}
	return slices.Clone(s.kids)
}

// Digest is "sha256:<hex>" over the key ids and keys (not the document's
// formatting): two sets with the same keys have the same digest.
func (s *JWKS) Digest() string {
	if s == nil {
		return ""
	}
	return s.digest
}

// KubernetesKeyID is the kid Kubernetes gives a service-account signing key:
// the unpadded base64url SHA-256 of its PKIX DER public key.
func KubernetesKeyID(pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", fmt.Errorf("marshal public key: %w", err)
	}
	sum := sha256.Sum256(der)
	return base64.RawURLEncoding.EncodeToString(sum[:]), nil
}

// EncodeJWKS writes public keys (RSA or ECDSA P-256) as a JWKS document in
// the form Kubernetes serves at /openid/v1/jwks, keyed by their kid, in
// kid order. For pinning a key in a policy and for tests.
func EncodeJWKS(keys map[string]crypto.PublicKey) ([]byte, error) {
	kids := make([]string, 0, len(keys))
	for kid := range keys {
		kids = append(kids, kid)
	}
	slices.Sort(kids)
	out := struct {
		Keys []map[string]string `json:"keys"`
	}{Keys: []map[string]string{}}
	b64 := base64.RawURLEncoding.EncodeToString
	for _, kid := range kids {
		switch k := keys[kid].(type) {
		case *rsa.PublicKey:
			out.Keys = append(out.Keys, map[string]string{"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
				"n": b64(k.N.Bytes()), "e": b64(big.NewInt(int64(k.E)).Bytes())})
		case *ecdsa.PublicKey:
			raw, err := k.Bytes()
			if err != nil || k.Curve != elliptic.P256() {
				return nil, fmt.Errorf("kid %q: only P-256 EC keys", kid)
			}
			out.Keys = append(out.Keys, map[string]string{"kty": "EC", "kid": kid, "use": "sig", "alg": "ES256",
				"crv": "P-256", "x": b64(raw[1:33]), "y": b64(raw[33:])})
		default:
			return nil, fmt.Errorf("kid %q: unsupported key type %T", kid, k)
		}
	}
	return json.Marshal(out)
}
