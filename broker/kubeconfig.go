package broker

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
)

// buildKubeconfig returns a complete kubeconfig for the ServiceAccount:
// the cluster's external URL and CA bundle, the token, and a current
// context in the ServiceAccount's namespace, so that kubectl works with it
// as is.
//
// It writes the YAML directly: the shape is fixed, and going through
// sigs.k8s.io/yaml (JSON, then a YAML parse and emit) was a sixth of the
// broker's CPU per issuance in make bench's profile. Every string is
// written as a JSON string, which is a valid YAML double-quoted scalar, so
// no value can break the document; TestKubeconfigMatchesClientcmd checks
// the result against client-go's own types.
func buildKubeconfig(cluster ClusterSpec, namespace, serviceAccount, token string) ([]byte, error) {
	user := serviceAccount + "@" + cluster.Name
	ctxName := namespace + "/" + serviceAccount + "@" + cluster.Name
	var b bytes.Buffer
	b.Grow(512 + len(token) + base64.StdEncoding.EncodedLen(len(cluster.CAData)))
	b.WriteString("apiVersion: v1\nkind: Config\nclusters:\n- name: ")
	writeQuoted(&b, cluster.Name)
	b.WriteString("\n  cluster:\n    server: ")
	writeQuoted(&b, cluster.Server)
	b.WriteString("\n    certificate-authority-data: ")
	b.WriteString(base64.StdEncoding.EncodeToString([]byte(cluster.CAData)))
	b.WriteString("\nusers:\n- name: ")
	writeQuoted(&b, user)
	b.WriteString("\n  user:\n    token: ")
	writeQuoted(&b, token)
	b.WriteString("\ncontexts:\n- name: ")
	writeQuoted(&b, ctxName)
	b.WriteString("\n  context:\n    cluster: ")
	writeQuoted(&b, cluster.Name)
	b.WriteString("\n    user: ")
	writeQuoted(&b, user)
	b.WriteString("\n    namespace: ")
	writeQuoted(&b, namespace)
	b.WriteString("\ncurrent-context: ")
	writeQuoted(&b, ctxName)
	b.WriteString("\n")
	return b.Bytes(), nil
}

// writeQuoted writes s as a JSON string, which YAML reads as a
// double-quoted scalar with the same value.
func writeQuoted(b *bytes.Buffer, s string) {
	q, _ := json.Marshal(s) // a string always marshals
	b.Write(q)
}

// jtiFromPayload extracts the jti claim from a JWT's base64url payload.
func jtiFromPayload(payload string) string {
	raw, err := base64.RawURLEncoding.DecodeString(payload)
	if err != nil {
		return ""
	}
	var claims struct {
		JTI string `json:"jti"`
	}
	if json.Unmarshal(raw, &claims) != nil {
		return ""
	}
	return claims.JTI
}
