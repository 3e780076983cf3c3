package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"errors"
	"math/big"
	"net/url"
	"strings"
	"testing"
	"time"
)

// The fuzz targets cover every parser of untrusted input: PEM certificates
// and keys, identities, CSRs and join tokens. Regression inputs
// live in testdata/fuzz/<target>/ and run as part of `go test`.

func FuzzParseCertificatesPEM(f *testing.F) {
	ca, err := NewCA(CAOptions{Now: fixedNow})
	if err != nil {
		f.Fatal(err)
	}
	kp, err := ca.IssueClient(ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	if err != nil {
		f.Fatal(err)
	}
	root, err := NewCA(CAOptions{Now: fixedNow, PathLen: 1})
	if err != nil {
		f.Fatal(err)
	}
	csrPEM, _, err := NewCSR("spiffe://oc.example/cluster/west", nil)
	if err != nil {
		f.Fatal(err)
	}
	csr, id, err := ParseCSRPEM(csrPEM)
	if err != nil {
		f.Fatal(err)
	}
	clusterCA, err := root.SignClusterCA(csr, id, 0)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(ca.CertPEM())
	f.Add(append(append([]byte(nil), kp.CertPEM...), ca.CertPEM()...))
	f.Add(kp.KeyPEM)
	f.Add(clusterCA.CertPEM)
	f.Add([]byte("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"))
	f.Add([]byte("-----BEGIN CERTIFICATE-----\nProc-Type: 4,ENCRYPTED\n\nAAAA\n-----END CERTIFICATE-----\n"))
	f.Add(append(ca.CertPEM(), "trailing"...))
	f.Fuzz(func(t *testing.T, data []byte) {
		certs, err := ParseCertificatesPEM(data)
		if err != nil {
			if certs != nil {
				t.Fatal("certificates returned with an error")
			}
			return
		}
		if len(certs) == 0 || len(certs) > MaxCertificates {
			t.Fatalf("parsed %d certificates", len(certs))
		}
		// Re-encoding what was parsed parses to the same certificates.
		var again []byte
		for _, c := range certs {
			again = append(again, encodeCert(c.Raw)...)
			_ = Fingerprint(c)
			_, _ = IdentityFromCert(c)
			if id, err := ClusterCAIdentity(c); err == nil && !c.IsCA {
				t.Fatalf("%s: a cluster CA that is no CA", id)
			}
		}
		round, err := ParseCertificatesPEM(again)
		if err != nil || len(round) != len(certs) {
			t.Fatalf("re-encoded certificates do not parse: %v", err)
		}
		for i := range certs {
			if !bytes.Equal(round[i].Raw, certs[i].Raw) {
				t.Fatalf("certificate %d changed in a round trip", i)
			}
		}
	})
}

func FuzzParsePrivateKeyPEM(f *testing.F) {
	ca, err := NewCA(CAOptions{Now: fixedNow})
	if err != nil {
		f.Fatal(err)
	}
	key, err := ca.KeyPEM()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(key)
	f.Add(ca.CertPEM())
	f.Add([]byte("-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n"))
	f.Add([]byte("-----BEGIN RSA PRIVATE KEY-----\nMAA=\n-----END RSA PRIVATE KEY-----\n"))
	f.Add(append(append([]byte(nil), key...), key...))
	f.Fuzz(func(t *testing.T, data []byte) {
		signer, err := ParsePrivateKeyPEM(data)
		if err != nil {
			if signer != nil {
				t.Fatal("key returned with an error")
			}
			return
		}
		if signer.Public() == nil {
			t.Fatal("parsed key has no public key")
		}
		if _, err := encodeKey(signer); err != nil {
			t.Fatalf("parsed key does not marshal: %v", err)
		}
	})
}

func FuzzParseIdentity(f *testing.F) {
	for _, s := range []string{
		"spiffe://oc.example/cluster/west",
		"spiffe://local/cluster/a",
		"spiffe://oc.example/cluster/west/",
		"spiffe://oc.example:443/cluster/west",
		"spiffe://user@oc.example/cluster/west",
		"spiffe://oc.example/cluster/w%65st",
		"SPIFFE://OC.EXAMPLE/cluster/west",
		"spiffe:///cluster/",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		td, cluster, err := ParseIdentity(id)
		if err != nil {
			return
		}
		// Exactly one spelling per identity: parsing and building agree.
		built, err := ClusterIdentity(td, cluster)
		if err != nil {
			t.Fatalf("ParseIdentity accepted %q but ClusterIdentity(%q, %q) refused: %v", id, td, cluster, err)
		}
		if built != id {
			t.Fatalf("ParseIdentity(%q) round-trips to %q", id, built)
		}
	})
}

func FuzzParseCSRPEM(f *testing.F) {
	csrPEM, keyPEM, err := NewCSR("spiffe://oc.example/cluster/west", nil)
	if err != nil {
		f.Fatal(err)
	}
	ca, err := NewCA(CAOptions{Now: fixedNow})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(csrPEM)
	f.Add(keyPEM)
	f.Add(ca.CertPEM())
	f.Add(append(append([]byte(nil), csrPEM...), csrPEM...))
	f.Add(append(append([]byte(nil), csrPEM...), "trailing"...))
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\n-----END CERTIFICATE REQUEST-----\n"))
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\nMAA=\n-----END CERTIFICATE REQUEST-----\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		csr, id, err := ParseCSRPEM(data)
		if err != nil {
			if csr != nil || id != "" {
				t.Fatal("a CSR returned with an error")
			}
			if !errors.Is(err, ErrInvalidCSR) {
				t.Fatalf("error does not wrap ErrInvalidCSR: %v", err)
			}
			return
		}
		// What ParseCSRPEM accepts is a well-formed request that SignClient
		// turns into a certificate carrying the identity and nothing else.
		if csr.CheckSignature() != nil {
			t.Fatal("accepted a CSR whose signature does not verify")
		}
		if _, _, err := ParseIdentity(id); err != nil {
			t.Fatalf("accepted identity %q: %v", id, err)
		}
		kp, err := ca.SignClient(csr, id, time.Hour)
		if err != nil {
			t.Fatalf("SignClient refused an accepted CSR: %v", err)
		}
		if got, err := IdentityFromCert(kp.Cert); err != nil || got != id {
			t.Fatalf("signed certificate identity %q, %v; want %q", got, err, id)
		}
	})
}

// fuzzJoinTokenNow is the fuzz verifier's fixed clock; the seed tokens are
// valid at it.
var fuzzJoinTokenNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

func FuzzVerifyJoinToken(f *testing.F) {
	now := func() time.Time { return fuzzJoinTokenNow }
	ca, err := NewCA(CAOptions{Now: now})
	if err != nil {
		f.Fatal(err)
	}
	other, err := NewCA(CAOptions{Now: now})
	if err != nil {
		f.Fatal(err)
	}
	pub := ca.Certificate().PublicKey.(*ecdsa.PublicKey)
	v := NewJoinTokenVerifier([]*x509.Certificate{ca.Certificate()}, now)
	for _, c := range []*CA{ca, other} {
		token, _, err := c.IssueJoinToken(JoinTokenOptions{Identity: "spiffe://oc.example/cluster/west"})
		if err != nil {
			f.Fatal(err)
		}
		f.Add(token)
		parts := strings.Split(token, ".")
		f.Add(parts[0] + "." + parts[1] + ".")
		f.Add(parts[0] + "." + parts[1] + "." + parts[2] + "." + parts[2])
	}
	f.Add("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.e30.")
	f.Add("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.e30.")
	f.Add("..")
	f.Add("")
	f.Fuzz(func(t *testing.T, token string) {
		claims, err := v.Verify(token)
		if err != nil {
			if !errors.Is(err, ErrInvalidJoinToken) {
				t.Fatalf("error does not wrap ErrInvalidJoinToken: %v", err)
			}
			if len(token) > 16 && strings.Contains(err.Error(), token) {
				t.Fatal("the error contains the token")
			}
			return
		}
		// Accepted: the token must carry an ES256 signature by the test
		// CA's key over its first two segments, checked here without
		// golang-jwt.
		parts := strings.Split(token, ".")
		if len(parts) != 3 || len(token) > MaxJoinTokenBytes {
			t.Fatalf("accepted a token of %d segments and %d bytes", len(parts), len(token))
		}
		sig, err := base64.RawURLEncoding.Strict().DecodeString(parts[2])
		if err != nil || len(sig) != 64 {
			t.Fatalf("accepted a token with a malformed signature")
		}
		digest := sha256.Sum256([]byte(parts[0] + "." + parts[1]))
		r, s := new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:])
		if !ecdsa.Verify(pub, digest[:], r, s) {
			t.Fatal("accepted a token not signed by the CA key")
		}
		if _, _, err := ParseIdentity(claims.Identity); err != nil || claims.ID == "" {
			t.Fatalf("accepted claims %+v", claims)
		}
	})
}

// FuzzParseUserCSRPEM: a peer's CSR for a Kubernetes client certificate
// (POST /v1/kubeconfigs with credential clientCertificate) is untrusted
// input. Whatever it is, parsing neither panics nor returns a CSR with an
// error, and an accepted CSR keeps ParseUserCSRPEM's promises.
func FuzzParseUserCSRPEM(f *testing.F) {
	csrPEM, keyPEM, _, err := NewUserCSR(func(crypto.PublicKey) (string, error) {
		return "tokenbroker:west:0123456789abcdef0123456789abcdef", nil
	}, nil)
	if err != nil {
		f.Fatal(err)
	}
	idCSR, _, err := NewCSR("spiffe://oc.example/cluster/west", nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(csrPEM)
	f.Add(keyPEM)
	f.Add(idCSR)
	f.Add(append(append([]byte(nil), csrPEM...), csrPEM...))
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\nMAA=\n-----END CERTIFICATE REQUEST-----\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		csr, cn, err := ParseUserCSRPEM(data)
		if err != nil {
			if csr != nil || cn != "" {
				t.Fatal("a CSR returned with an error")
			}
			if !errors.Is(err, ErrInvalidCSR) {
				t.Fatalf("error does not wrap ErrInvalidCSR: %v", err)
			}
			return
		}
		if cn == "" || cn != csr.Subject.CommonName || len(csr.Subject.Names) != 1 {
			t.Fatalf("accepted a subject other than one common name: %v", csr.Subject)
		}
		if len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses)+len(csr.URIs) != 0 {
			t.Fatal("accepted a CSR with SANs")
		}
		if csr.CheckSignature() != nil {
			t.Fatal("accepted a CSR whose signature does not verify")
		}
	})
}

func FuzzParseJWKS(f *testing.F) {
	k := newWorkloadKeys(f)
	f.Add(k.raw)
	f.Add([]byte(`{"keys":[]}`))
	f.Add([]byte(`{"keys":[{"kty":"RSA","kid":"a","n":"AQAB","e":"AQAB"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		set, err := ParseJWKS(data)
		if err != nil {
			if set != nil {
				t.Fatal("a set returned with an error")
			}
			return
		}
		kids := set.KeyIDs()
		if len(kids) == 0 || len(kids) > MaxJWKSKeys || !strings.HasPrefix(set.Digest(), "sha256:") {
			t.Fatalf("parsed %d keys, digest %q", len(kids), set.Digest())
		}
		// What was parsed encodes and parses to the same keys.
		keys := map[string]crypto.PublicKey{}
		for _, kid := range kids {
			pub, _, ok := set.Key(kid)
			if !ok {
				t.Fatalf("kid %q listed but not found", kid)
			}
			keys[kid] = pub
		}
		raw, err := EncodeJWKS(keys)
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseJWKS(raw)
		if err != nil || again.Digest() != set.Digest() {
			t.Fatalf("re-encoded set differs: %v", err)
		}
	})
}

func FuzzVerifyWorkloadToken(f *testing.F) {
	k := newWorkloadKeys(f)
	f.Add(k.sign(f, workloadClaims()))
	f.Add("eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0.")
	f.Add("a.b.c")
	f.Fuzz(func(t *testing.T, token string) {
		c, err := VerifyWorkloadToken(token, []*JWKS{k.jwks}, testWorkloadOptions())
		if err != nil {
			var te *WorkloadTokenError
			if !errors.As(err, &te) || te.Reason == "" {
				t.Fatalf("refusal without a reason: %v", err)
			}
			if len(token) >= 16 && strings.Contains(err.Error(), token) {
				t.Fatal("the error echoes the token")
			}
			return
		}
		// Only a token signed with the key verifies: its claims are the
		// ones the test signs.
		if c.Namespace != "argo" || c.ServiceAccount != "runner" {
			t.Fatalf("verified a token for %s/%s", c.Namespace, c.ServiceAccount)
		}
	})
}

// FuzzPinnedBundle feeds a served trust bundle, which whoever answers the
// bootstrap request chooses, to PinnedBundle: whatever it holds, what is
// kept starts with the pinned CA and is only CAs that chain to it.
func FuzzPinnedBundle(f *testing.F) {
	pinned, err := NewCA(CAOptions{Now: fixedNow, PathLen: 1, CommonName: "pinned"})
	if err != nil {
		f.Fatal(err)
	}
	inter, err := pinned.NewIntermediate(CAOptions{CommonName: "pinned intermediate"})
	if err != nil {
		f.Fatal(err)
	}
	other, err := NewCA(CAOptions{Now: fixedNow, CommonName: "other"})
	if err != nil {
		f.Fatal(err)
	}
	pin := Fingerprint(pinned.Certificate())
	f.Add(pinned.CertPEM())
	f.Add(append(other.CertPEM(), pinned.CertPEM()...))
	f.Add(append(append(pinned.CertPEM(), encodeCert(inter.Certificate().Raw)...), other.CertPEM()...))
	f.Add(append(append(other.CertPEM(), encodeCert(inter.Certificate().Raw)...), pinned.CertPEM()...))
	f.Add([]byte("not a bundle"))
	now := fixedNow()
	f.Fuzz(func(t *testing.T, data []byte) {
		kept, err := PinnedBundle(data, pin, now)
		if err != nil {
			if kept != nil {
				t.Fatal("certificates kept with an error")
			}
			return
		}
		if len(kept) == 0 || !kept[0].Equal(pinned.Certificate()) {
			t.Fatal("the pinned CA is not first")
		}
		for _, c := range kept[1:] {
			if !c.IsCA || c.Equal(other.Certificate()) {
				t.Fatalf("kept %s, which is no CA under the pin", c.Subject)
			}
		}
	})
}

// FuzzTrustedBundle feeds a renewal answer's caBundle, which the broker
// chooses (and fills with its whole client-CA bundle), to TrustedBundle
// with the operators' root as the trust in service: whatever it holds,
// what is kept is only that root and CAs that chain to it.
func FuzzTrustedBundle(f *testing.F) {
	root, err := NewCA(CAOptions{Now: fixedNow, PathLen: 1, CommonName: "root"})
	if err != nil {
		f.Fatal(err)
	}
	inter, err := root.NewIntermediate(CAOptions{CommonName: "root's intermediate"})
	if err != nil {
		f.Fatal(err)
	}
	partner, err := NewCA(CAOptions{Now: fixedNow, CommonName: "partner"})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(root.CertPEM())
	f.Add(append(root.CertPEM(), partner.CertPEM()...))
	f.Add(append(append(partner.CertPEM(), encodeCert(inter.Certificate().Raw)...), root.CertPEM()...))
	f.Add(partner.CertPEM())
	f.Add([]byte("not a bundle"))
	now := fixedNow()
	anchors := []*x509.Certificate{root.Certificate()}
	f.Fuzz(func(t *testing.T, data []byte) {
		kept, err := TrustedBundle(data, anchors, now)
		if err != nil {
			if kept != nil {
				t.Fatal("certificates kept with an error")
			}
			return
		}
		certs, err := ParseCertificatesPEM(kept)
		if err != nil || len(certs) == 0 {
			t.Fatalf("kept no certificates without an error: %v", err)
		}
		for _, c := range certs {
			if !c.IsCA || c.Equal(partner.Certificate()) {
				t.Fatalf("kept %s, which is no CA under the trusted root", c.Subject)
			}
		}
	})
}

// FuzzMergeCABundles feeds two ClusterTrustBundles' trustBundle fields,
// which anyone allowed to attest for the signer writes, to MergeCABundles:
// whatever they hold, what comes out is distinct CA certificates, at most
// MaxCertificates, each from a bundle that parsed whole.
func FuzzMergeCABundles(f *testing.F) {
	ca, err := NewCA(CAOptions{Now: fixedNow, CommonName: "ctb"})
	if err != nil {
		f.Fatal(err)
	}
	other, err := NewCA(CAOptions{Now: fixedNow, CommonName: "other"})
	if err != nil {
		f.Fatal(err)
	}
	kp, err := ca.IssueClient(ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(ca.CertPEM(), other.CertPEM())
	f.Add(ca.CertPEM(), ca.CertPEM())
	f.Add(append(append([]byte(nil), kp.CertPEM...), ca.CertPEM()...), other.CertPEM())
	f.Add([]byte(""), []byte("not a bundle"))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		certs, skipped, err := MergeCABundles([][]byte{a, b})
		if err != nil {
			if certs != nil {
				t.Fatal("certificates returned with an error")
			}
			return
		}
		if len(certs) > MaxCertificates || len(skipped) > 2 {
			t.Fatalf("%d certificates, %d skipped", len(certs), len(skipped))
		}
		var parsed []*x509.Certificate
		for _, in := range [][]byte{a, b} {
			if p, err := ParseCertificatesPEM(in); err == nil && firstNonCA(p) < 0 {
				parsed = append(parsed, p...)
			}
		}
		for i, c := range certs {
			if !c.BasicConstraintsValid || !c.IsCA {
				t.Fatalf("certificate %d is not a CA", i)
			}
			if !containsCert(parsed, c) || containsCert(certs[:i], c) {
				t.Fatalf("certificate %d is not from a good bundle, or twice", i)
			}
		}
	})
}

// FuzzWorkloadFromChain reads a pod certificate's names (its URI SAN and
// subject, and its issuer's URI SAN and name constraint), which a source
// cluster's signer chose: whatever it accepts is a workload of the very
// cluster its CA names, a Pod of a valid uid, and nothing else.
func FuzzWorkloadFromChain(f *testing.F) {
	f.Add("spiffe://oc.example/cluster/east/ns/argo/sa/runner", "runner-0", "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54", "spiffe://oc.example/cluster/east", "oc.example")
	f.Add("spiffe://oc.example/cluster/west/ns/argo/sa/runner", "runner-0", "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54", "spiffe://oc.example/cluster/east", "oc.example")
	f.Add("spiffe://oc.example/cluster/east/ns/argo/sa/runner/x", "", "", "spiffe://oc.example/cluster/east", "")
	f.Fuzz(func(t *testing.T, leafURI, podName, podUID, caURI, permitted string) {
		leaf := &x509.Certificate{Subject: pkix.Name{CommonName: podName, SerialNumber: podUID}}
		if u, err := url.Parse(leafURI); err == nil {
			leaf.URIs = []*url.URL{u}
		}
		ca := &x509.Certificate{BasicConstraintsValid: true, IsCA: true, MaxPathLenZero: true, KeyUsage: x509.KeyUsageCertSign,
			PermittedURIDomains: []string{permitted}}
		if u, err := url.Parse(caURI); err == nil {
			ca.URIs = []*url.URL{u}
		}
		root := &x509.Certificate{BasicConstraintsValid: true, IsCA: true}
		w, err := WorkloadFromChain([][]*x509.Certificate{{leaf, ca, root}})
		if err != nil {
			if !errors.Is(err, ErrNotPodCertificate) {
				t.Fatalf("a refusal that is not ErrNotPodCertificate: %v", err)
			}
			return
		}
		own, err := ClusterCAIdentity(ca)
		if err != nil || own != w.Cluster {
			t.Fatalf("accepted under CA %q (%v), workload of %q", own, err, w.Cluster)
		}
		cluster, ns, sa, err := ParseWorkloadIdentity(w.Identity)
		if err != nil || cluster != w.Cluster || ns != w.Namespace || sa != w.ServiceAccount || w.Identity != leaf.URIs[0].String() {
			t.Fatalf("accepted %+v for the URI %q (%v)", w, leafURI, err)
		}
		if !ValidUID(w.PodUID) || w.PodName == "" {
			t.Fatalf("accepted the Pod %q uid %q", w.PodName, w.PodUID)
		}
	})
}
